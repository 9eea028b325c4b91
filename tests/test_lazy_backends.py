"""Selecting one backend never imports another (megatron-core is installed in the workspace)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    from miles.config import load_recipe, validate_components
    from miles.driver.components import build_components
    from miles.plugins import get_plugin_manager, make_component

    config = load_recipe("default", ["backend=fsdp"])
    validate_components(config, load=True)
    get_plugin_manager()
    make_component("backend", config.backend)
    from miles.models.registry import resolve_model

    build_components(config, resolve_model(config.model.path))
    # miles-megatron's plugin hooks (its recipe section, its pre-flight check) load with every run;
    # megatron-core and the backend itself must not.
    light = ("miles_megatron", "miles_megatron.hooks", "miles_megatron.config")
    heavy = sorted(
        m for m in sys.modules
        if m.split(".")[0] in ("megatron", "miles_megatron", "transformer_engine") and m not in light
    )
    print("IMPORTED:" + ",".join(heavy))
    """
)


def test_fsdp_run_setup_never_imports_megatron():
    assert importlib.util.find_spec("megatron") is not None, "megatron-core should be installed for this test"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith("IMPORTED:"))
    assert line == "IMPORTED:", line


def test_unselected_backend_entry_point_is_not_imported(fake_site):
    fake_site.module("fake_heavy_backend.backend", "raise RuntimeError('imported although not selected')\n")
    fake_site.dist(
        "fake-heavy-backend", "1.0", {"miles.backends": {"heavy": "fake_heavy_backend.backend:Backend"}}
    )
    from miles.config import load_recipe, validate_components
    from miles.plugins import list_plugins

    validate_components(load_recipe("default", ["backend=fsdp"]), load=True)
    assert not fake_site.imported("fake_heavy_backend.backend")
    assert any(p.distribution == "fake-heavy-backend" for p in list_plugins())
