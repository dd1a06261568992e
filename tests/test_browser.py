"""Every kind of report opened in headless Chromium at 1280 px: it loads without a console
error, nothing overflows the page sideways, every figure decodes, every link resolves.

Chromium is Debian's `chromium` + `chromium-driver` (installed by .ci/run), driven by Selenium.
With QUANTLAB_SCREENSHOTS=DIR the screenshots are kept there (docs/screenshots holds them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from quantlab.cli import main

DIGITS = "calibration_data/digits/calibration.npy"
WIDTH = 1280
HEIGHT = 900
KINDS = ["calibrate", "validate", "plan", "sweep", "compare", "index", "demo"]


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for program, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(program) is None:
            return f"{program} is not installed (apt-get install {package}; .ci/run does it)"
    return None


pytestmark = pytest.mark.skipif(_browser_missing() is not None,
                                reason=str(_browser_missing()))


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """kind -> the report page of one tiny digits-cnn run of that kind (calibrate writes no page
    of its own: its page is that of the validate run inside its folder)."""
    root = tmp_path_factory.mktemp("pages")
    quiet = ["--no-progress"]
    data = ["--data", DIGITS, "--max-samples", "64"]
    assert main(["calibrate", "digits-cnn", *data, "--out", str(root / "cal"), *quiet]) == 0
    assert main(["calibrate", "digits-cnn", *data, "--method", "percentile", "--weight-amax",
                 "max", "--no-bias-correction", "--no-equalize", "--out", str(root / "plain"),
                 *quiet]) == 0
    for name in ("cal", "plain"):
        assert main(["validate", "--from", str(root / name), "--data", DIGITS, "--max-samples",
                     "32", "--metric", "agreement", "--out", str(root / name / "validate"),
                     *quiet]) == 0
    assert main(["plan", "digits-cnn", "--data", str(root / "cal"), "--eval", "zoo",
                 "--metric", "top1", "--max-samples", "64", "--max-drop", "0.05",
                 "--out", str(root / "plan"), *quiet]) == 0
    assert main(["sweep", "digits-cnn", "--data", "zoo", "--eval", "zoo", "--metric", "top1",
                 "--max-samples", "64", "--methods", "max", "percentile", "--percentiles",
                 "99.9", "--calib-sizes", "16", "64", "--resamples", "100",
                 "--out", str(root / "sweep"), *quiet]) == 0
    assert main(["demo", "--models", "digits-cnn", "--methods", "max", "--eval-limit", "64",
                 "--out", str(root / "demo"), *quiet]) == 0
    assert main(["compare", str(root / "cal"), str(root / "plain"),
                 "--out", str(root / "compare.html")]) == 0
    assert main(["report", str(root), "--out", str(root / "index.html")]) == 0
    return {"calibrate": root / "cal" / "validate" / "report.html",
            "validate": root / "plain" / "validate" / "report.html",
            "plan": root / "plan" / "report.html", "sweep": root / "sweep" / "report.html",
            "compare": root / "compare.html", "index": root / "index.html",
            "demo": root / "demo" / "report.html"}


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


def _local_file(href: str) -> Path | None:
    """The file a file:// link points at (None for a link inside the page)."""
    url = urlparse(href)
    return Path(unquote(url.path)) if url.scheme == "file" else None


@pytest.mark.parametrize("kind", KINDS)
def test_report_loads_fits_1280px_with_figures_decoded_and_links_resolved(pages, browser,
                                                                          kind, tmp_path):
    page = pages[kind]
    assert page.is_file(), f"{kind} wrote no page"
    browser.get_log("browser")  # drop what an earlier page logged
    browser.get(page.as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
    width = browser.execute_script("return document.documentElement.clientWidth")
    assert width == WIDTH
    overflow = browser.execute_script("return document.documentElement.scrollWidth")
    assert overflow <= width, f"{kind}: the page is {overflow} px wide at {width} px"
    images = browser.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
    assert all(complete and natural > 0 for complete, natural in images), images
    if kind in ("validate", "plan", "sweep", "compare", "demo"):
        assert images, f"the {kind} report has no figure"
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
    written = pages["index"].parent  # every run of the fixture, so every file quantlab wrote
    for href in links:
        target = _local_file(href)
        if target is None:
            continue
        if urlparse(href).fragment and target == page:
            assert browser.execute_script(
                "return document.getElementById(arguments[0]) !== null",
                unquote(urlparse(href).fragment)), href
            continue
        assert target.is_file() and written in target.parents, f"{kind}: link {href}"
    if kind == "index":
        assert links, "the index links no report"
    _screenshot(browser, kind, tmp_path)


def _screenshot(browser, kind: str, tmp_path: Path) -> None:
    """The first screen at 1280 px, quantized to a small PNG, in QUANTLAB_SCREENSHOTS."""
    from PIL import Image

    folder = Path(os.environ.get("QUANTLAB_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    raw = tmp_path / f"{kind}-raw.png"
    assert browser.save_screenshot(str(raw))
    with Image.open(raw) as image:
        assert image.width == WIDTH
        image.convert("RGB").quantize(colors=64).save(folder / f"{kind}.png", optimize=True)
