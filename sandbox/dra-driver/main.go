// Command dra-driver is meshtrain's simulated GPU DRA driver: a kubelet plugin built on
// k8s.io/dynamic-resource-allocation/kubeletplugin. It publishes the node's simulated GPUs
// (product, memory, NVLink clique, PCIe root, NUMA node) in a ResourceSlice and, when the
// kubelet prepares a claim, writes a CDI spec that puts the allocated devices' names and
// uuids into the container's environment. The sandbox runs one per node.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

// driverName is the DRA driver name, the devices' attribute domain and the DeviceClass's name.
const driverName = "gpu.sim.meshtrain.io"

// Socket names shorter than the driver's: a unix socket's path holds at most 107 bytes, and the
// sandbox's kubelet root dirs are deep (the kubelet finds the plugin by any socket name in
// plugins_registry; GetInfo tells it the driver's name and the DRA socket's path).
const (
	registrarSocket = "gpu-sim.sock"
	pluginDirName   = "gpu-sim"
)

func main() {
	klog.InitFlags(nil)
	nodeName := flag.String("node-name", "", "the node this plugin runs on (the pool is named after it)")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	configPath := flag.String("config", "", "the node's JSON config: productName, memory, cliqueId, gpus[{pcieRoot, numaNode}]")
	kubeletRoot := flag.String("kubelet-root-dir", "/var/lib/kubelet", "the kubelet's --root-dir (plugins_registry and plugins live there)")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "where CDI specs go (one of the runtime's cdi_spec_dirs)")
	flag.Parse()
	if *nodeName == "" || *configPath == "" {
		fmt.Fprintln(os.Stderr, "dra-driver: --node-name and --config are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *nodeName, *kubeconfig, *configPath, *kubeletRoot, *cdiDir); err != nil {
		klog.ErrorS(err, "dra-driver failed")
		klog.Flush()
		os.Exit(1)
	}
}

// run publishes the node's devices and serves the kubelet until ctx ends or a fatal error.
func run(ctx context.Context, nodeName, kubeconfig, configPath, kubeletRoot, cdiDir string) error {
	config, err := readConfig(configPath)
	if err != nil {
		return err
	}
	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	pluginDir := filepath.Join(kubeletRoot, "plugins", pluginDirName)
	registrarDir := filepath.Join(kubeletRoot, "plugins_registry")
	for _, dir := range []string{pluginDir, registrarDir, cdiDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	prepared, err := preparedClaims(cdiDir)
	if err != nil {
		return err
	}
	published := devices(nodeName, config)
	uuids := make(map[string]string, len(published))
	for _, device := range published {
		uuids[device.Name] = *device.Attributes["uuid"].StringValue
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	plugin := &driver{node: nodeName, cdiDir: cdiDir, uuids: uuids, cancel: cancel, inUse: prepared}
	helper, err := kubeletplugin.Start(ctx, plugin,
		kubeletplugin.DriverName(driverName),
		kubeletplugin.NodeName(nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(registrarDir),
		kubeletplugin.RegistrarSocketFilename(registrarSocket),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
	)
	if err != nil {
		return fmt.Errorf("start the kubelet plugin: %w", err)
	}
	defer helper.Stop()
	pools := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Slices: []resourceslice.Slice{{Devices: published}}},
	}}
	if err := helper.PublishResources(ctx, pools); err != nil {
		return fmt.Errorf("publish ResourceSlices: %w", err)
	}
	klog.InfoS("serving", "driver", driverName, "node", nodeName, "devices", len(published), "prepared claims", len(prepared))
	<-ctx.Done()
	if cause := context.Cause(ctx); cause != nil && cause != context.Canceled {
		return cause
	}
	return nil
}
