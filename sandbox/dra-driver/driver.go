package main

// The DRAPlugin: prepares a claim by checking its allocation against the node's devices
// and writing the claim's CDI spec; unprepares by removing it.

import (
	"context"
	"errors"
	"fmt"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
)

// driver implements kubeletplugin.DRAPlugin for one node.
type driver struct {
	node   string
	cdiDir string
	// uuids maps each published device name to its uuid.
	uuids map[string]string
	// cancel stops the process on a fatal background error.
	cancel context.CancelCauseFunc

	mu sync.Mutex
	// inUse maps a prepared claim's UID to its devices (the last line of defense
	// against two claims sharing a device).
	inUse map[string][]string
}

var _ kubeletplugin.DRAPlugin = (*driver)(nil)

// PrepareResourceClaims writes one CDI spec per claim; each claim's result names that CDI device.
func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := d.prepare(claim)
		if err != nil {
			klog.FromContext(ctx).Error(err, "prepare failed", "claim", klog.KObj(claim))
		}
		result[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return result, nil
}

func (d *driver) prepare(claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	uid := string(claim.UID)
	owner := d.owners()
	var names, uuids, held []string
	var devices []kubeletplugin.Device
	for _, result := range claim.Status.Allocation.Devices.Results {
		if result.Driver != driverName {
			continue // another driver's device in the same claim
		}
		if result.Pool != d.node {
			return nil, fmt.Errorf("claim %s/%s: device %s is in pool %s, not this node's (%s)", claim.Namespace, claim.Name, result.Device, result.Pool, d.node)
		}
		uuid, ok := d.uuids[result.Device]
		if !ok {
			return nil, fmt.Errorf("claim %s/%s: device %s is not published by this node", claim.Namespace, claim.Name, result.Device)
		}
		// An admin-access result (a monitoring agent's) shares the device: it neither waits for
		// nor keeps out the claim the device is allocated to.
		if admin := result.AdminAccess != nil && *result.AdminAccess; !admin {
			if other, taken := owner[result.Device]; taken && other != uid {
				return nil, fmt.Errorf("claim %s/%s: device %s is already prepared for claim %s", claim.Namespace, claim.Name, result.Device, other)
			}
			held = append(held, result.Device)
		}
		names = append(names, result.Device)
		uuids = append(uuids, uuid)
		devices = append(devices, kubeletplugin.Device{
			Requests:   []string{result.Request},
			PoolName:   result.Pool,
			DeviceName: result.Device,
		})
	}
	if len(devices) == 0 {
		return nil, nil
	}
	if err := writeSpec(d.cdiDir, d.node, uid, names, uuids, held); err != nil {
		return nil, err
	}
	// One CDI device per claim carries the env for all its devices: attach it once.
	devices[0].CDIDeviceIDs = []string{cdiDeviceID(uid)}
	d.inUse[uid] = held
	return devices, nil
}

// owners maps each device in use to the UID of the claim it is prepared for.
func (d *driver) owners() map[string]string {
	owner := map[string]string{}
	for uid, names := range d.inUse {
		for _, name := range names {
			owner[name] = uid
		}
	}
	return owner
}

// UnprepareResourceClaims removes the claims' CDI specs; claims never prepared are fine.
func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	result := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		err := removeSpec(d.cdiDir, string(claim.UID))
		if err == nil {
			delete(d.inUse, string(claim.UID))
		}
		result[claim.UID] = err
	}
	return result, nil
}

// HandleError logs background errors (publishing slices); a fatal one stops the driver.
func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	runtime.HandleErrorWithContext(ctx, err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.cancel(fmt.Errorf("fatal background error: %w", err))
	}
}
