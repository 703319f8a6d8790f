"""deploy/k8s and deploy/Dockerfile: the manifests are valid Kubernetes (strict schema of
a pinned version), and what they run is what pfs accepts: every container's command
parses with pfs's own parsers, the configs of the ConfigMap load with pfs's config
loaders, and every path a config names lies in a volume the container mounts."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pfs.core.config import ClientConfig, DataConfig, MetaConfig, from_dict
from pfs.dataserver.__main__ import parse_args as data_args
from pfs.metaserver.__main__ import build_config
from pfs.metaserver.__main__ import parse_args as meta_args
from pfs.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# the Kubernetes version the manifests are written for (deploy/k8s/README.md)
KUBERNETES_VERSION = "1.34.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _documents()


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] in ("StatefulSet", "DaemonSet", "Deployment")]


def _config_map() -> dict[str, str]:
    (cm,) = _by_kind("ConfigMap")
    data: dict[str, str] = cm["data"]
    return data


def _container(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, container) of the workload whose container is ``name``."""
    for w in _workloads():
        spec = dict(w["spec"]["template"]["spec"])
        # a StatefulSet's claim templates are volumes of its pods too
        claims = [{"name": t["metadata"]["name"], "persistentVolumeClaim": t["spec"]}
                  for t in w["spec"].get("volumeClaimTemplates", [])]
        spec["volumes"] = spec["volumes"] + claims
        for c in spec["containers"]:
            if c["name"] == name:
                return spec, c
    raise AssertionError(f"no container {name!r} in {K8S}")


def test_there_is_a_manifest_for_each_part() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    assert {("Namespace", "pfs"), ("ConfigMap", "pfs-config"), ("Service", "pfs-meta"),
            ("StatefulSet", "pfs-meta"), ("DaemonSet", "pfs-data"),
            ("DaemonSet", "pfs-mount")} <= kinds


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_manifest_is_valid_kubernetes_in_strict_mode(name: str, doc: dict[str, Any]) -> None:
    # strict: an unknown or misspelt field is an error, not silently dropped by the API
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    (sts,) = _by_kind("StatefulSet")
    bad = yaml.safe_load(yaml.safe_dump(sts))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # missing "s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_selectors_match_their_pods() -> None:
    for w in _workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        for k, v in w["spec"]["selector"]["matchLabels"].items():
            assert labels.get(k) == v, w["metadata"]["name"]
    (svc,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == "pfs-meta"]
    (sts,) = _by_kind("StatefulSet")
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def _load(cls: type[Any], text: str) -> Any:
    return from_dict(cls, tomllib.loads(text))


def test_configs_load_with_pfs_own_loaders() -> None:
    data = _config_map()
    meta = _load(MetaConfig, data["meta.toml"])
    server = _load(DataConfig, data["data.toml"])
    client = _load(ClientConfig, data["client.toml"])
    # the addresses the data servers and the mounts use are the metaserver's headless name
    (sts,) = _by_kind("StatefulSet")
    ns = sts["metadata"]["namespace"]
    expected = f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}.{ns}.svc.cluster.local"
    for cfg in (server, client):
        host, _, port = cfg.meta.rpartition(":")
        assert host == expected and int(port) == meta.port
    # the client's key is one the metaserver knows
    assert client.key_name in {k.name for k in meta.node_keys}


def _mounted_paths(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for m in container["volumeMounts"]:
        assert m["name"] in volumes, f"{container['name']}: no volume {m['name']!r}"
        out[m["mountPath"]] = dict(volumes[m["name"]], subPath=m.get("subPath"))
    return out


def _lies_in(path: str, mounts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    for mp, vol in mounts.items():
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            return vol
    return None


def _secret_holds(vol: dict[str, Any], path: str, mount_path: str) -> None:
    """A key file in a Secret volume: readable by its owner only (pfs refuses others)."""
    assert "secret" in vol, f"{path} is not in a Secret"
    assert vol["secret"]["defaultMode"] & 0o077 == 0, f"{path}: group/others may read it"
    assert "/" not in path[len(mount_path.rstrip("/")) + 1:]


@pytest.mark.parametrize("container,config_key,cls", [
    ("metaserver", "meta.toml", MetaConfig),
    ("dataserver", "data.toml", DataConfig),
    ("mount", "client.toml", ClientConfig),
])
def test_each_container_mounts_what_its_config_names(container: str, config_key: str,
                                                     cls: type[Any]) -> None:
    spec, c = _container(container)
    mounts = _mounted_paths(spec, c)
    # the config file itself comes from the ConfigMap, under the key of that name
    args = c["args"]
    config_path = args[args.index("--config") + 1]
    vol = mounts[config_path]
    assert vol["configMap"]["name"] == "pfs-config" and vol["subPath"] == config_key
    cfg = _load(cls, _config_map()[config_key])
    paths = [cfg.key_file]
    if isinstance(cfg, MetaConfig):
        paths += [cfg.db] + [k.file for k in cfg.node_keys]
    if isinstance(cfg, DataConfig):
        paths += list(cfg.dirs)
    for path in paths:
        holder = _lies_in(path, mounts)
        assert holder is not None, f"{container}: {path} is in no volume it mounts"
        if path.endswith(".key"):
            mp = next(m for m in mounts if path.startswith(m.rstrip("/") + "/"))
            _secret_holds(holder, path, mp)


def test_container_commands_parse_with_pfs_parsers(tmp_path: Path) -> None:
    data = _config_map()

    def local(args: list[str], key: str) -> list[str]:
        """The container's args with --config pointing at a copy of the ConfigMap's file."""
        f = tmp_path / key
        f.write_text(data[key])
        i = args.index("--config")
        return args[:i + 1] + [str(f)] + args[i + 2:]

    _, meta = _container("metaserver")
    assert meta["args"][:2] == ["meta", "serve"]
    cfg = build_config(meta_args(local(meta["args"][2:], "meta.toml")))
    assert cfg.port == 9400 and cfg.db == "/var/lib/pfs/meta"

    _, ds = _container("dataserver")
    assert ds["args"][:2] == ["data", "serve"]
    dcfg = data_args(local(ds["args"][2:], "data.toml"))[0]
    assert dcfg.port == 9500 and dcfg.local_socket

    _, mnt = _container("mount")
    ns = build_parser().parse_args(mnt["args"])
    assert ns.mountpoint == "/mnt/pfs"
    (stop_cmd,) = [mnt["lifecycle"]["preStop"]["exec"]["command"]]
    assert stop_cmd[0] == "pfs"
    assert build_parser().parse_args(stop_cmd[1:]).mountpoint == "/mnt/pfs"


def test_ports_match_the_configs() -> None:
    data = _config_map()
    meta = _load(MetaConfig, data["meta.toml"])
    server = _load(DataConfig, data["data.toml"])
    _, m = _container("metaserver")
    _, d = _container("dataserver")
    assert {p["containerPort"] for p in m["ports"]} == {meta.port, meta.metrics_port}
    assert {p["containerPort"] for p in d["ports"]} == {server.port, server.metrics_port}
    assert m["readinessProbe"]["tcpSocket"]["port"] == meta.port
    assert d["readinessProbe"]["tcpSocket"]["port"] == server.port


def test_node_placement_and_propagation() -> None:
    data_spec, _ = _container("dataserver")
    mount_spec, mount = _container("mount")
    # data servers only on nodes labelled for NVMe, on the drive through a hostPath
    assert data_spec["nodeSelector"] == {"pfs.io/nvme": "true"}
    drive = _lies_in(_load(DataConfig, _config_map()["data.toml"]).dirs[0],
                     _mounted_paths(*_container("dataserver")))
    assert drive is not None and "hostPath" in drive
    # short-circuit: the data server's local socket is an abstract Unix socket, which
    # lives in a network namespace: the mount must share the node's with the server
    assert data_spec["hostNetwork"] and mount_spec["hostNetwork"]
    for spec in (data_spec, mount_spec):
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    # the mount reaches the host (and the node's other pods) only with Bidirectional
    (mnt,) = [m for m in mount["volumeMounts"] if m["mountPath"] == "/mnt/pfs"]
    assert mnt["mountPropagation"] == "Bidirectional"
    assert mount["securityContext"]["privileged"] is True  # required for Bidirectional
    # the metaserver's store is a persistent volume claimed per pod
    (sts,) = _by_kind("StatefulSet")
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    meta_mounts = _mounted_paths(*_container("metaserver"))
    store = _load(MetaConfig, _config_map()["meta.toml"]).db
    owner = next(mp for mp in meta_mounts if store.startswith(mp.rstrip("/") + "/"))
    (vm,) = [m for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
             if m["mountPath"] == owner]
    assert vm["name"] in claims


def test_dockerfile_builds_from_files_that_exist() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists(), f"Dockerfile copies {part}, which does not exist"
    # the entrypoint is the console script pyproject installs
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert 'ENTRYPOINT ["pfs"]' in text and "pfs" in pyproject["project"]["scripts"]
    # every image the manifests run is the one this Dockerfile's comment tags
    tag = re.search(r"-t (\S+) \.", text)
    assert tag is not None
    images = {c["image"] for w in _workloads()
              for c in w["spec"]["template"]["spec"]["containers"]}
    assert images == {tag.group(1)}
    assert tag.group(1).endswith(":" + pyproject["project"]["version"])

