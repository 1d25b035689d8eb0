package main

// CDI specs: one file per prepared claim in the node's CDI directory (the one its
// containerd scans, cdi_spec_dirs). Each defines one CDI device named after the claim's
// UID whose edits put the allocated devices' names and uuids into the container's env.

import (
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
)

const (
	// cdiKind is the CDI "vendor/class" of the devices this driver defines.
	cdiKind = driverName + "/gpu"
	// cdiVersion is the CDI spec version written (env edits and annotations need >= 0.6.0).
	cdiVersion = "0.6.0"
	// annotationDevices records, in a spec, the devices its claim holds (comma-separated; not
	// those it shares through admin access).
	annotationDevices = driverName + "/devices"
	// maxSpecBytes bounds a spec file read back at startup.
	maxSpecBytes = 64 << 10
)

// Env variables the driver injects into containers that use a claim.
const (
	EnvGPUs  = "MESHTRAIN_SIM_GPUS"
	EnvUUIDs = "MESHTRAIN_SIM_GPU_UUIDS"
	EnvNode  = "MESHTRAIN_SIM_GPU_NODE"
)

// cdiSpec is the subset of the CDI spec format (github.com/cncf-tags/container-device-interface) written here.
type cdiSpec struct {
	Version     string            `json:"cdiVersion"`
	Kind        string            `json:"kind"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Devices     []cdiDevice       `json:"devices"`
}

type cdiDevice struct {
	Name           string   `json:"name"`
	ContainerEdits cdiEdits `json:"containerEdits"`
}

type cdiEdits struct {
	Env []string `json:"env,omitempty"`
}

// specPath is the claim's spec file.
func specPath(dir, claimUID string) string {
	return filepath.Join(dir, fmt.Sprintf("%s-%s.json", strings.ReplaceAll(driverName, ".", "_"), claimUID))
}

// cdiDeviceID is the fully qualified CDI device the kubelet passes to the runtime.
func cdiDeviceID(claimUID string) string {
	return cdiKind + "=" + claimUID
}

// writeSpec writes (atomically) the spec of a claim prepared with these devices, of which it
// holds held (the others it shares through admin access).
func writeSpec(dir, node, claimUID string, names, uuids, held []string) error {
	spec := cdiSpec{
		Version:     cdiVersion,
		Kind:        cdiKind,
		Annotations: map[string]string{annotationDevices: strings.Join(held, ",")},
		Devices: []cdiDevice{{
			Name: claimUID,
			ContainerEdits: cdiEdits{Env: []string{
				EnvGPUs + "=" + strings.Join(names, ","),
				EnvUUIDs + "=" + strings.Join(uuids, ","),
				EnvNode + "=" + node,
			}},
		}},
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	// The runtime reads *.json only: the temporary file is invisible to it until renamed.
	tmp := specPath(dir, claimUID) + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("write CDI spec: %w", err)
	}
	return os.Rename(tmp, specPath(dir, claimUID))
}

// removeSpec deletes a claim's spec; a missing one is not an error (unprepare is idempotent).
func removeSpec(dir, claimUID string) error {
	if err := os.Remove(specPath(dir, claimUID)); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("remove CDI spec: %w", err)
	}
	return nil
}

// preparedClaims reads back the specs in dir: claim UID -> devices, so a restarted driver
// still knows which devices are in use. A spec it cannot read (unreadable, oversized, not
// one this driver wrote: a crash mid-write, say) is logged and skipped, never a reason for the
// plugin not to start: the kubelet prepares its claim again, which writes it anew.
func preparedClaims(dir string) (map[string][]string, error) {
	paths, err := filepath.Glob(specPath(dir, "*"))
	if err != nil {
		return nil, err
	}
	prepared := map[string][]string{}
	for _, path := range paths {
		spec, err := readSpec(path)
		if err != nil {
			log.Printf("skipping CDI spec %s: %v", path, err)
			continue
		}
		if held := spec.Annotations[annotationDevices]; held != "" {
			prepared[spec.Devices[0].Name] = strings.Split(held, ",")
		} else { // an admin-access claim: it holds nothing
			prepared[spec.Devices[0].Name] = nil
		}
	}
	return prepared, nil
}

// readSpec reads one spec file this driver wrote (bounded to maxSpecBytes).
func readSpec(path string) (*cdiSpec, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if info.Size() > maxSpecBytes {
		return nil, fmt.Errorf("over %d bytes", maxSpecBytes)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var spec cdiSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	if len(spec.Devices) != 1 {
		return nil, fmt.Errorf("%d devices, not the one this driver writes", len(spec.Devices))
	}
	return &spec, nil
}
