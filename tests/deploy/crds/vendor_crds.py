"""Writes the CRD schemas the chart and the KubeRay manifests are validated against, from the
upstream repositories' release tags: the storage version's openAPIV3Schema of each CRD, with
its `description` texts dropped (they are most of the size and never constrain anything).

    python tests/deploy/crds/vendor_crds.py KUBERAY_GIT PROM_OPERATOR_GIT KEDA_GIT

Each argument is a git directory of that repository (a clone or a bare mirror). The sources,
tags and licenses are in README.md beside this file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCES = [  # (which argument, tag, path in the repository)
    (0, "v1.7.0", "ray-operator/config/crd/bases/ray.io_rayclusters.yaml"),
    (0, "v1.7.0", "ray-operator/config/crd/bases/ray.io_rayservices.yaml"),
    (1, "v0.93.0", "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"),
    (1, "v0.93.0", "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml"),
    (2, "v2.20.2", "config/crd/bases/keda.sh_scaledobjects.yaml"),
]


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(repos: list[str]) -> None:
    for which, tag, path in SOURCES:
        text = subprocess.run(["git", "--git-dir", repos[which], "show", f"{tag}:{path}"],
                              capture_output=True, text=True, check=True).stdout
        crd = yaml.safe_load(text)
        spec = crd["spec"]
        (version,) = [v for v in spec["versions"] if v.get("storage")]
        out = {"apiVersion": f"{spec['group']}/{version['name']}", "kind": spec["names"]["kind"],
               "source": f"{Path(repos[which]).parent.name}@{tag}:{path}",
               "schema": strip(version["schema"]["openAPIV3Schema"])}
        name = f"{spec['group']}_{spec['names']['plural']}.json"
        (HERE / name).write_text(json.dumps(out, separators=(",", ":"), sort_keys=True) + "\n")
        print(name, len((HERE / name).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
