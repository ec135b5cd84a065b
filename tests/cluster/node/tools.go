//go:build tools

// Package tools pins the container runtime the cluster tests' real node runs
// (containerd, its runc shim, ctr, crictl). It is never compiled: the blank
// imports only make `go mod tidy` keep every module those programs need, so
// build.sh can `go build` them from this module.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
