"""The HTML report in a real browser: headless Chromium renders both charts, loads nothing.

Skipped where no Chromium is installed (Debian: ``apt-get install chromium``; CI installs it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from leantrain.diagnose import run_doctor
from leantrain.diagnose.report import PHASE_COLOURS, write_html
from tests.conftest import RegressionTask, quiet_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")

# No sandbox (CI runs as root), no GPU, and no background traffic: this machine has no network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]  # fmt: skip


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def test_the_report_renders_its_charts_offline(tmp_path: Path) -> None:
    diagnosis = run_doctor(RegressionTask(), quiet_config(tmp_path / "run"), steps=4, warmup=1)
    page = write_html(diagnosis, tmp_path / "report.html")
    screenshot = tmp_path / "report.png"
    shot = chromium(
        tmp_path / "profile", "--window-size=1200,2400", f"--screenshot={screenshot}", page.as_uri()
    )
    # The page's policy forbids every load but inline styles and data: images; a violation is logged.
    assert "Content Security Policy" not in shot.stderr
    pixels = matplotlib.image.imread(screenshot)[..., :3]
    assert pixels.shape[:2] == (2400, 1200)

    def area(colour: str) -> int:
        rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        return int((np.abs(pixels - rgb).max(axis=-1) < 0.02).sum())

    # The bars of the phase chart (forward, backward) and of the memory chart are drawn.
    assert area(PHASE_COLOURS["forward"]) > 2000
    assert area(PHASE_COLOURS["backward"]) > 2000
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri()).stdout
    assert dom.count("<svg") == 2 and "leantrain doctor" in dom
