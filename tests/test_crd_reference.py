"""docs/crd-reference.md is generated from crds/dlrmjob.yaml and must match it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "crd_reference.py"


def test_reference_is_up_to_date() -> None:
    gen = load_script("scripts/crd_reference.py")
    expected = gen.render(yaml.safe_load(gen.CRD.read_text()))
    assert gen.OUT.read_text() == expected, (
        "docs/crd-reference.md is out of date with crds/dlrmjob.yaml: "
        "run python scripts/crd_reference.py"
    )


def test_reference_covers_every_field_and_rule() -> None:
    gen = load_script("scripts/crd_reference.py")
    crd = yaml.safe_load(gen.CRD.read_text())
    text = gen.render(crd)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in ("spec", "status"):
        for path, _, _ in gen._fields(schema["properties"][part], part, True):
            if path != part:
                assert f"| `{path}` |" in text, path
    for _, rule, _ in gen._rules(schema, ""):
        assert rule.replace("|", "\\|") in text
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        assert f"| {column['name']} | `{column['jsonPath']}` |" in text


def test_check_mode_reports_a_stale_reference(tmp_path: Path) -> None:
    gen = load_script("scripts/crd_reference.py")
    crd = yaml.safe_load(gen.CRD.read_text())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "suspend"
    ]["description"] = "changed"
    assert gen.render(crd) != gen.OUT.read_text()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout


def test_the_docs_show_the_printer_columns_kubectl_prints() -> None:
    """``kubectl get dj`` prints the CRD's columns, upper-cased; the docs' comments say
    the same, in order (the default ones, then what ``-o wide`` adds)."""
    crd = yaml.safe_load((ROOT / "crds" / "dlrmjob.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    default = ["NAME", *(c["name"].upper() for c in columns if not c.get("priority"))]
    wide = [c["name"].upper() for c in columns if c.get("priority")]
    text = (ROOT / "docs" / "install.md").read_text()
    plain = next(line for line in text.splitlines() if line.startswith("kubectl get dj -n "))
    assert plain.split("# ", 1)[1] == " ".join(default)
    wide_line = next(line for line in text.splitlines() if "get dj" in line and "-o wide" in line)
    comment = wide_line.split("# + ", 1)[1]
    shown = [part.split(" (")[0].strip() for part in comment.split(", ")]
    assert shown == wide
