// Command cluster-dns is the cluster tests' DNS: CoreDNS with only the plugins a
// cluster's DNS needs to answer <service>.<namespace>.svc.cluster.local from the
// apiserver (kubernetes), on the node's address (bind), logging failures (errors).
// Built from this module's pins by ../node/build.sh; nothing else of CoreDNS is
// compiled in (its full plugin set pulls in every cloud SDK).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func init() {
	// The order CoreDNS's own plugin.cfg gives these three.
	dnsserver.Directives = []string{"bind", "errors", "kubernetes"}
}

func main() { coremain.Run() }
