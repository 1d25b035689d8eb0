package main

// Prepare/unprepare against a claim's allocation, and the CDI spec it leaves on disk.

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

func newDriver(t *testing.T) *driver {
	config := &NodeConfig{ProductName: "NVIDIA H200", Memory: "141Gi", CliqueID: "c.0", GPUs: make([]GPU, 8)}
	uuids := map[string]string{}
	for _, device := range devices("n0", config) {
		uuids[device.Name] = *device.Attributes["uuid"].StringValue
	}
	return &driver{node: "n0", cdiDir: t.TempDir(), uuids: uuids, inUse: map[string][]string{}}
}

func claim(uid, pool string, names ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: uid, Namespace: "ns", UID: types.UID(uid)}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, name := range names {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpus", Driver: driverName, Pool: pool, Device: name})
	}
	return c
}

func TestPrepareWritesTheClaimsEnvAndUnprepareRemovesIt(t *testing.T) {
	d := newDriver(t)
	result, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{claim("u1", "n0", "gpu-0", "gpu-3")})
	if err != nil || result["u1"].Err != nil {
		t.Fatalf("prepare: %v %v", err, result["u1"].Err)
	}
	if got := result["u1"].Devices[0].CDIDeviceIDs; len(got) != 1 || got[0] != "gpu.sim.meshtrain.io/gpu=u1" {
		t.Fatalf("CDI device IDs %v", got)
	}
	data, err := os.ReadFile(specPath(d.cdiDir, "u1"))
	if err != nil {
		t.Fatal(err)
	}
	var spec cdiSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	env := strings.Join(spec.Devices[0].ContainerEdits.Env, ";")
	want := "MESHTRAIN_SIM_GPUS=gpu-0,gpu-3;MESHTRAIN_SIM_GPU_UUIDS=" + d.uuids["gpu-0"] + "," + d.uuids["gpu-3"]
	if !strings.HasPrefix(env, want) {
		t.Fatalf("env %q, want prefix %q", env, want)
	}
	prepared, err := preparedClaims(d.cdiDir)
	if err != nil || strings.Join(prepared["u1"], ",") != "gpu-0,gpu-3" {
		t.Fatalf("read back %v %v", prepared, err)
	}
	unprepared, err := d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "u1"}, {UID: "never-prepared"}})
	if err != nil || unprepared["u1"] != nil || unprepared["never-prepared"] != nil {
		t.Fatalf("unprepare: %v %v", err, unprepared)
	}
	if _, err := os.Stat(specPath(d.cdiDir, "u1")); !os.IsNotExist(err) {
		t.Fatalf("spec left behind: %v", err)
	}
}

func TestPrepareRefusesForeignUnknownAndDoublyUsedDevices(t *testing.T) {
	d := newDriver(t)
	if r, _ := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{claim("u1", "n0", "gpu-1")}); r["u1"].Err != nil {
		t.Fatal(r["u1"].Err)
	}
	for _, c := range []*resourceapi.ResourceClaim{
		claim("u2", "n1", "gpu-2"), // another node's pool
		claim("u3", "n0", "gpu-9"), // not published
		claim("u4", "n0", "gpu-1"), // prepared for u1
	} {
		r, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c})
		if err != nil || r[c.UID].Err == nil {
			t.Errorf("claim %s: prepared, want an error", c.UID)
		}
	}
	// Preparing u1 again (a kubelet restart) is fine.
	if r, _ := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{claim("u1", "n0", "gpu-1")}); r["u1"].Err != nil {
		t.Fatal(r["u1"].Err)
	}
}

func TestACorruptOrOversizedSpecIsSkippedNotFatal(t *testing.T) {
	d := newDriver(t)
	if _, err := d.prepare(claim("good", "n0", "gpu-1")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(specPath(d.cdiDir, "torn"), []byte(`{"cdiVersion": "0.6`), 0o644); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, maxSpecBytes+1)
	if err := os.WriteFile(specPath(d.cdiDir, "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	prepared, err := preparedClaims(d.cdiDir)
	if err != nil || len(prepared) != 1 || strings.Join(prepared["good"], ",") != "gpu-1" {
		t.Fatalf("read back %v %v, want only the good spec", prepared, err)
	}
}

func TestAnAdminAccessClaimSharesDevicesInUse(t *testing.T) {
	d := newDriver(t)
	if _, err := d.prepare(claim("u1", "n0", "gpu-1")); err != nil {
		t.Fatal(err)
	}
	admin := claim("monitor", "n0", "gpu-1", "gpu-2")
	yes := true
	for i := range admin.Status.Allocation.Devices.Results {
		admin.Status.Allocation.Devices.Results[i].AdminAccess = &yes
	}
	if _, err := d.prepare(admin); err != nil {
		t.Fatalf("admin access to a device in use: %v", err)
	}
	if _, err := d.prepare(claim("u2", "n0", "gpu-2")); err != nil {
		t.Fatalf("a device an admin claim sees is still free: %v", err)
	}
	prepared, err := preparedClaims(d.cdiDir)
	if err != nil || len(prepared["monitor"]) != 0 || strings.Join(prepared["u2"], ",") != "gpu-2" {
		t.Fatalf("read back %v %v", prepared, err)
	}
}
