package main

// The simulated GPUs a node publishes: read from the node's config file (the sandbox
// writes one per node), turned into resource.k8s.io/v1 devices.

import (
	"crypto/sha1"
	"encoding/json"
	"fmt"
	"os"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
)

// maxGPUs bounds the devices one node may declare (a ResourceSlice holds at most 128).
const maxGPUs = 64

// pcieRootAttribute is the standard attribute naming a device's PCIe root complex
// (the one the scheduler's matchAttribute and other drivers use for locality).
const pcieRootAttribute resourceapi.QualifiedName = "resource.kubernetes.io/pcieRoot"

// GPU is one simulated device's place on the node.
type GPU struct {
	// PCIeRoot is the device's PCIe root complex, e.g. "pci0000:00".
	PCIeRoot string `json:"pcieRoot"`
	// NUMANode is the NUMA node the device is attached to.
	NUMANode int64 `json:"numaNode"`
}

// NodeConfig is the per-node config file.
type NodeConfig struct {
	// ProductName as NVIDIA's driver reports it, e.g. "NVIDIA H200".
	ProductName string `json:"productName"`
	// Memory per device, a quantity such as "141Gi".
	Memory string `json:"memory"`
	// CliqueID is the node's NVLink domain, in the form of the nvidia.com/gpu.clique label.
	CliqueID string `json:"cliqueId"`
	// GPUs lists the devices gpu-0, gpu-1, ... in index order.
	GPUs []GPU `json:"gpus"`
}

// readConfig parses and checks the node's config file.
func readConfig(path string) (*NodeConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the node config: %w", err)
	}
	var config NodeConfig
	if err := json.Unmarshal(data, &config); err != nil {
		return nil, fmt.Errorf("parse the node config %s: %w", path, err)
	}
	if len(config.GPUs) == 0 || len(config.GPUs) > maxGPUs {
		return nil, fmt.Errorf("node config %s: gpus must list 1..%d devices, it lists %d", path, maxGPUs, len(config.GPUs))
	}
	if _, err := resource.ParseQuantity(config.Memory); err != nil {
		return nil, fmt.Errorf("node config %s: memory %q is not a quantity (e.g. 141Gi): %w", path, config.Memory, err)
	}
	if config.ProductName == "" || config.CliqueID == "" {
		return nil, fmt.Errorf("node config %s: productName and cliqueId are required", path)
	}
	return &config, nil
}

// deviceName is the name of the index-th device on every node.
func deviceName(index int) string {
	return fmt.Sprintf("gpu-%d", index)
}

// deviceUUID is a stable, node-unique uuid in NVIDIA's "GPU-<uuid>" form.
func deviceUUID(node string, index int) string {
	sum := sha1.Sum([]byte(fmt.Sprintf("%s/%d", node, index)))
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", sum[0:4], sum[4:6], sum[6:8], sum[8:10], sum[10:16])
}

// devices turns the config into the devices of the node's one ResourceSlice.
func devices(node string, config *NodeConfig) []resourceapi.Device {
	memory := resource.MustParse(config.Memory)
	out := make([]resourceapi.Device, 0, len(config.GPUs))
	for index, gpu := range config.GPUs {
		out = append(out, resourceapi.Device{
			Name: deviceName(index),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":            {StringValue: ptr.To("gpu")},
				"index":           {IntValue: ptr.To(int64(index))},
				"uuid":            {StringValue: ptr.To(deviceUUID(node, index))},
				"productName":     {StringValue: ptr.To(config.ProductName)},
				"cliqueId":        {StringValue: ptr.To(config.CliqueID)},
				"numaNode":        {IntValue: ptr.To(gpu.NUMANode)},
				pcieRootAttribute: {StringValue: ptr.To(gpu.PCIeRoot)},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: memory},
			},
		})
	}
	return out
}
