"""The real node beside kwok's fake ones: what controlplane.py needs to run it.

One kubelet, kube-proxy and containerd (runc, CNI bridge) run inside a network, mount and
pid namespace of their own, made by `unshare` around ../node/supervisor.py, so every
address, route, bridge and iptables rule they make lives in that network namespace, every
mount in that mount namespace, and all of it dies with the supervisor. The control plane
stays in the machine's namespace on 127.0.0.1; socat forwarders joined by unix sockets
(a unix socket is not bound to a network namespace) carry the two directions:

    host  127.0.0.1:<kubelet port> -> kubelet.sock  -> node 10.250.0.1:<kubelet port>
    node  10.250.0.1:6443          -> apiserver.sock -> host 127.0.0.1:<apiserver port>

Pods reach the apiserver as in-cluster clients do: kubernetes.default.svc (10.96.0.1:443)
goes through kube-proxy's rules to the node-side forwarder, because the control plane
writes the `kubernetes` Service's endpoints to point there (the apiserver runs with
--endpoint-reconciler-type=none). The apiserver reaches the kubelet (logs, exec,
port-forward) at the Node's InternalIP 127.0.0.1, patched into its status (the kubelet
refuses a loopback node IP and then leaves the addresses alone).

Only the Python standard library (and the binaries named) is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE_SRC = HERE.parent / "node"
SUPERVISOR = NODE_SRC / "supervisor.py"

NODE_NAME = "real-0"
NODE_KIND = "real"
NODE_KIND_LABEL = "omni-operator.test/node-kind"
# Tests that know nothing of the real node must never land on it: their pods have
# images that exist nowhere (kwok only pretends to run them).
TAINT_KEY = "omni-operator.test/real-node"
# The node's own address, on lo inside its network namespace; nothing outside that
# namespace can reach it, which is the point.
NODE_ADDRESS = "10.250.0.1"
POD_SUBNET = "10.251.0.0/24"
# Where pods find the apiserver: the node-side forwarder.
APISERVER_NODE_PORT = 6443
# containerd 2.4's default sandbox image; made here from the pinned pause.c.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
PROBE_IMAGE_NAME = "omni-operator.test/omni-probe"

NODE_BINARIES = (
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "crictl",
    "omni-probe",
    "pause",
    "cluster-dns",
)
# The cluster's DNS answers on the node's address, as kube-dns's Service IP would: pods
# resolve <service>.<namespace>.svc.cluster.local (and a Service's short name within its
# namespace) as in any cluster.
CLUSTER_DOMAIN = "cluster.local"
DNS_PORT = 53
CONTROLPLANE_NODE_BINARIES = ("kubelet", "kube-proxy")
HOST_TOOLS = ("unshare", "socat", "runc", "ip", "iptables", "iptables-save", "iptables-restore")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")


def cache_root() -> Path:
    env = os.environ.get("OMNI_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "omni-operator"


def default_node_bin_dir() -> Path:
    if env := os.environ.get("OMNI_NODE_BIN"):
        return Path(env)
    out = subprocess.run(
        ["bash", str(NODE_SRC / "build.sh"), "--print-bin-dir"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def cni_bin_dir() -> Path | None:
    for d in CNI_DIRS:
        if all(os.access(Path(d) / p, os.X_OK) for p in CNI_PLUGINS):
            return Path(d)
    return None


def unavailable_reason(bin_dir: Path, node_bin_dir: Path) -> str | None:
    """Why the real node cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the real node needs root (network, mount and pid namespaces, cgroups)"
    missing = [b for b in CONTROLPLANE_NODE_BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        return f"{', '.join(missing)} missing in {bin_dir} (run {HERE / 'build.sh'})"
    missing = [b for b in NODE_BINARIES if not os.access(node_bin_dir / b, os.X_OK)]
    if missing:
        return f"{', '.join(missing)} missing in {node_bin_dir} (run {NODE_SRC / 'build.sh'})"
    tools = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if tools:
        return (
            f"{', '.join(tools)} not on PATH (apt-get install util-linux socat runc iproute2 "
            "iptables)"
        )
    if cni_bin_dir() is None:
        return (
            f"CNI plugins {', '.join(CNI_PLUGINS)} not found in {' or '.join(CNI_DIRS)} "
            "(apt-get install containernetworking-plugins)"
        )
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"unshare --net --mount --pid cannot run here: {probe.stderr.strip()}"
    if (
        not Path("/sys/fs/cgroup/memory").is_dir()
        and not Path("/sys/fs/cgroup/cgroup.controllers").exists()
    ):
        return "no cgroup hierarchy under /sys/fs/cgroup"
    return None


def socket_dir(state_dir: Path) -> Path:
    """A short host path for the unix sockets: the state dir may be too long for one
    (108 bytes), e.g. a pytest temp dir named after a test."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
    return Path("/tmp") / f"omni-node-{digest}"


def cgroup_root(state_dir: Path) -> str:
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
    return f"/omni-node-{digest}"


def cgroup_mounts() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named ones, cgroup2)."""
    found: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0] if post else ""
        if fstype in ("cgroup", "cgroup2"):
            mnt = Path(pre.split()[4])
            if mnt not in found:
                found.append(mnt)
    return found


def remove_cgroups(root: str) -> list[str]:
    """rmdir the node's cgroup tree, leaves first; returns what could not be removed."""
    left: list[str] = []
    for mnt in cgroup_mounts():
        top = mnt / root.lstrip("/")
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                left.append(f"{d}: {exc.strerror}")
    return left


# --- images made here ---------------------------------------------------------------


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class OciImage:
    ref: str
    config_digest: str  # what CRI calls the image id
    archive: bytes


def oci_image(ref: str, files: dict[str, tuple[bytes, int]], entrypoint: list[str]) -> OciImage:
    """A one-layer image from scratch holding files {path: (content, mode)}, as an OCI
    archive. Byte for byte the same for the same input, so its id tells whether a
    containerd already has it."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(content), mode, 0
            tar.addfile(info, io.BytesIO(content))
    # Uncompressed: gzip of the probe's 6 MB costs seconds of every start, and the
    # archive never leaves this machine.
    layer_tar = layer_buf.getvalue()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [_sha(layer_tar)]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _sha(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _sha(layer_tar),
                    "size": len(layer_tar),
                }
            ],
        },
        sort_keys=True,
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _sha(manifest),
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref,
                    },
                }
            ],
        },
        sort_keys=True,
    ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = {
            "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
            "index.json": index,
            **{f"blobs/sha256/{_sha(b)[7:]}": b for b in (layer_tar, config, manifest)},
        }
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return OciImage(ref, _sha(config), out.getvalue())


def node_images(node_bin_dir: Path) -> list[OciImage]:
    """The pause image containerd needs for every pod and the tests' omni-probe image,
    tagged by the hash of its binary so a rebuilt probe is a new tag."""
    pause = (node_bin_dir / "pause").read_bytes()
    probe = (node_bin_dir / "omni-probe").read_bytes()
    probe_tag = hashlib.sha256(probe).hexdigest()[:12]
    return [
        oci_image(PAUSE_IMAGE, {"/pause": (pause, 0o755)}, ["/pause"]),
        oci_image(
            f"{PROBE_IMAGE_NAME}:{probe_tag}",
            {"/omni-probe": (probe, 0o755)},
            ["/omni-probe"],
        ),
    ]


def normalize_ref(ref: str) -> str:
    """The name a pod's `image:` resolves to in CRI (docker.io/library/... for short names)."""
    name, tag = ref, ""
    if "@" in name:
        name, _, digest = name.partition("@")
        tag = "@" + digest
    elif ":" in name.rsplit("/", 1)[-1]:
        name, _, t = name.rpartition(":")
        tag = ":" + t
    else:
        tag = ":latest"
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    return name + tag


def stale_image_refs(images: list[tuple[str, str]], want: str) -> list[str]:
    """Of containerd's images (name, manifest digest), the names a load of ``want`` left
    stale: another build under want's repository, whatever registry host names it (an
    import also names it as podman did, localhost/...), and the id and digest names
    (sha256:..., import-...@sha256:...) of content no other name holds any more."""

    def repository(ref: str) -> str | None:
        if ref.startswith("sha256:") or "@" in ref or ":" not in ref:
            return None
        name = ref.rpartition(":")[0]
        first, _, rest = name.partition("/")
        # docker.io/x/y and localhost/x/y are one repository x/y here.
        return rest if rest and ("." in first or first == "localhost") else name

    digest = dict(images).get(want)
    if digest is None:
        return []
    stale = {ref for ref, d in images if d != digest and repository(ref) == repository(want)}
    named = {d for ref, d in images if repository(ref) is not None and ref not in stale}
    stale |= {ref for ref, d in images if repository(ref) is None and d not in named}
    return sorted(stale)


def archive_blob_digest(member: str) -> str | None:
    """The digest an OCI archive member holds (``blobs/<alg>/<hex>``), else None."""
    parts = member.removeprefix("./").split("/")
    if len(parts) == 3 and parts[0] == "blobs" and parts[1] and parts[2]:
        return f"{parts[1]}:{parts[2]}"
    return None


# --- configuration files ---------------------------------------------------------------


@dataclass(frozen=True)
class NodeLayout:
    state_dir: Path
    node_dir: Path
    sock_dir: Path
    logs: Path
    pki: Path
    bin_dir: Path
    node_bin_dir: Path
    kubelet_port: int
    apiserver_port: int
    cgroup_root: str

    @property
    def containerd_sock(self) -> Path:
        return self.sock_dir / "containerd.sock"


def containerd_root() -> tuple[Path, Path]:
    """containerd's root dir (content store, images, snapshots) kept between runs, so an
    image imported once is there on the next start; and the lock that keeps two nodes
    from opening it at once."""
    base = cache_root() / "node-containerd"
    return base / "root", base / "root.lock"


def write_configs(lay: NodeLayout, images: list[OciImage]) -> Path:
    """Write every config the supervisor needs; returns the supervisor's JSON config."""
    nd = lay.node_dir
    nd.mkdir(parents=True, exist_ok=True)
    (nd / "cni").mkdir(exist_ok=True)
    cni_bin = cni_bin_dir()
    assert cni_bin is not None
    # Plugins this node never uses are left out: each would otherwise look for its
    # device, kernel module or directory on the machine.
    disabled = [
        "io.containerd.snapshotter.v1.btrfs",
        "io.containerd.snapshotter.v1.zfs",
        "io.containerd.snapshotter.v1.devmapper",
        "io.containerd.snapshotter.v1.blockfile",
        "io.containerd.snapshotter.v1.erofs",
        "io.containerd.internal.v1.opt",
        "io.containerd.nri.v1.nri",
        "io.containerd.tracing.processor.v1.otlp",
        "io.containerd.internal.v1.tracing",
    ]
    cd_root, _ = containerd_root()
    (nd / "containerd.toml").write_text(
        f"""version = 3
root = "{cd_root}"
state = "/run/containerd"
disabled_plugins = {json.dumps(disabled)}

[grpc]
  address = "{lay.containerd_sock}"

[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  # Images only ever come from imports; a pull would leave the machine.
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # runc's write of a pod's negative oom_score_adj is refused without CAP_SYS_RESOURCE.
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  cdi_spec_dirs = []
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{nd / "cni"}"
    use_internal_loopback = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc")}"
        SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
    )
    (nd / "cni" / "10-omni-node.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "omni-node",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": "cni0",
                        "isGateway": True,
                        # kube-proxy masquerades Service traffic; nothing leaves the
                        # namespace, so there is nothing else to masquerade.
                        "ipMasq": False,
                        # A pod reaching itself through its Service comes back on its own port.
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_SUBNET}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": str(nd / "cni-ipam"),
                        },
                    }
                ],
            },
            indent=2,
        )
    )
    (nd / "resolv.conf").write_text("# no DNS: the node's pods reach nothing outside\n")
    pki = lay.pki
    kubelet_config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_ADDRESS,
        "port": lay.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "authentication": {
            "x509": {"clientCAFile": str(pki / "ca.crt")},
            "webhook": {"enabled": False},
            "anonymous": {"enabled": False},
        },
        # Only holders of a certificate from the test CA get here at all.
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{lay.containerd_sock}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": lay.cgroup_root,
        # This machine has cgroup v1 only.
        "failCgroupV1": False,
        # The kubelet would write vm.overcommit_memory, kernel.panic and
        # kernel.panic_on_oops machine-wide; protectKernelDefaults makes it check
        # instead, and the supervisor shows it the values it wants.
        "protectKernelDefaults": True,
        "oomScoreAdj": 0,
        "enforceNodeAllocatable": [],
        "clusterDNS": [NODE_ADDRESS],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(nd / "resolv.conf"),
        "podLogsDir": str(nd / "pod-logs"),
        "failSwapOn": False,
        "serializeImagePulls": False,
        "maxPods": 30,
        # Images here exist only as imports: collecting one loses it for good, and a
        # shared disk must not evict pods.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusReportFrequency": "10s",
    }
    (nd / "kubelet.json").write_text(json.dumps(kubelet_config, indent=2))
    server = f"https://{NODE_ADDRESS}:{APISERVER_NODE_PORT}"
    write_client_kubeconfig(nd / "kubelet.kubeconfig", pki, server, "kubelet-client")
    write_client_kubeconfig(nd / "kube-proxy.kubeconfig", pki, server, "kube-proxy")
    # The tests' admin certificate: CoreDNS lists and watches Services, EndpointSlices and
    # Namespaces cluster-wide, and this is test infrastructure, as the suite's kubectl is.
    write_client_kubeconfig(nd / "cluster-dns.kubeconfig", pki, server, "admin")
    # Only the cluster's zone: any other name fails at once (no upstream to forward to:
    # nothing outside this machine is reachable, nor should a test try).
    (nd / "Corefile").write_text(
        f"{CLUSTER_DOMAIN}:{DNS_PORT} {{\n"
        f"    bind {NODE_ADDRESS}\n"
        "    errors\n"
        f"    kubernetes {CLUSTER_DOMAIN} {{\n"
        f"        kubeconfig {nd / 'cluster-dns.kubeconfig'}\n"
        "    }\n"
        "}\n"
    )
    proxy_config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(nd / "kube-proxy.kubeconfig")},
        "hostnameOverride": NODE_NAME,
        "bindAddress": NODE_ADDRESS,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "detectLocalMode": "ClusterCIDR",
        # Masquerading all Service traffic sends a pod's replies back through the
        # node's conntrack even when client and backend share the bridge (no
        # br_netfilter here, which would be a machine-wide module and setting).
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
        "nodePortAddresses": [f"{NODE_ADDRESS}/32"],
        # Zero leaves the machine-wide conntrack table size and its hash size alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "oomScoreAdj": 0,
    }
    (nd / "kube-proxy.json").write_text(json.dumps(proxy_config, indent=2))

    image_files: list[dict[str, str]] = []
    for img in images:
        path = nd / f"image-{hashlib.sha256(img.ref.encode()).hexdigest()[:12]}.tar"
        path.write_bytes(img.archive)
        image_files.append({"ref": img.ref, "id": img.config_digest, "archive": str(path)})
    cd_root, cd_lock = containerd_root()
    sup = {
        "node_dir": str(nd),
        "logs": str(lay.logs),
        "sock_dir": str(lay.sock_dir),
        "node_address": NODE_ADDRESS,
        "apiserver_node_port": APISERVER_NODE_PORT,
        "kubelet_port": lay.kubelet_port,
        "cgroup_root": lay.cgroup_root,
        "containerd_root": str(cd_root),
        "containerd_lock": str(cd_lock),
        "containerd_config": str(nd / "containerd.toml"),
        "containerd_sock": str(lay.containerd_sock),
        "images": image_files,
        "bin": {
            **{b: str(lay.node_bin_dir / b) for b in NODE_BINARIES},
            **{b: str(lay.bin_dir / b) for b in CONTROLPLANE_NODE_BINARIES},
        },
        "kubelet_args": [
            f"--config={nd / 'kubelet.json'}",
            f"--kubeconfig={nd / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            # Refused as a loopback address, so the kubelet leaves the Node's
            # addresses to us: the InternalIP the apiserver can dial is 127.0.0.1.
            "--node-ip=127.0.0.1",
            f"--node-labels={NODE_KIND_LABEL}={NODE_KIND},type=real",
            "--v=1",
        ],
        "kube_proxy_args": [f"--config={nd / 'kube-proxy.json'}", "--v=1"],
        "cluster_dns_args": ["-conf", str(nd / "Corefile")],
    }
    path = nd / "supervisor.json"
    path.write_text(json.dumps(sup, indent=2))
    return path


def write_client_kubeconfig(path: Path, pki: Path, server: str, cert: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "omni-test",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": cert,
                "user": {
                    "client-certificate": str(pki / f"{cert}.crt"),
                    "client-key": str(pki / f"{cert}.key"),
                },
            }
        ],
        "contexts": [{"name": "omni-test", "context": {"cluster": "omni-test", "user": cert}}],
        "current-context": "omni-test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def kubernetes_endpoints() -> tuple[dict[str, object], dict[str, object]]:
    """The `kubernetes` Service's Endpoints and EndpointSlice: the node-side forwarder."""
    endpoints: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            # The slice below is written by hand; a mirrored one would be a duplicate.
            "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"},
        },
        "subsets": [
            {
                "addresses": [{"ip": NODE_ADDRESS}],
                "ports": [{"name": "https", "port": APISERVER_NODE_PORT, "protocol": "TCP"}],
            }
        ],
    }
    slice_: dict[str, object] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "controlplane.omni-operator.test",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [NODE_ADDRESS], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": APISERVER_NODE_PORT, "protocol": "TCP"}],
    }
    return endpoints, slice_


def remove_socket_dir(state_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(socket_dir(state_dir))
