"""The try-it page in a real headless browser: Debian's chromium driven by playwright (its own
browser downloads are not used: ``executable_path`` names the system's). Skipped where either is
missing; .ci/run installs chromium."""

import shutil
import struct

import pytest

httpx = pytest.importorskip("httpx")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

from serve_setup import source_texts  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser_path():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser found (%s); apt-get install chromium" % ", ".join(BROWSERS))


def png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_page_decodes_and_highlights_the_edits(served, cli_data, tmp_path):
    text = source_texts(cli_data, 1)[0]
    expected = httpx.post(served.url + "translate", json={"text": text, "return_edits": True},
                          timeout=120).json()
    edited = [e for e in expected["edits"][0] if e["op"] != "equal"]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path(),
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 700})
            page.set_default_timeout(60_000)
            page.goto(served.url)
            page.fill("#input", text)
            page.click("#go")
            page.wait_for_selector("#outputs .out")
            shown = page.inner_text("#outputs .out")
            deleted = page.locator("#outputs del").all_inner_texts()
            inserted = page.locator("#outputs ins").all_inner_texts()
            status = page.inner_text("#status")
            screenshot = page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
            # without the highlighting: the output as the API gives it
            page.uncheck("#edits")
            plain = page.inner_text("#outputs .out")
        finally:
            browser.close()
    assert plain == expected["outputs"][0]
    assert "1 text in" in status
    assert deleted == [e["source"] for e in edited if e["source"]]
    assert inserted == [e["output"] for e in edited if e["output"]]
    assert " ".join(shown.split()) == " ".join(
        " ".join(filter(None, (e["source"], e["output"]))) if e["op"] != "equal" else e["output"]
        for e in expected["edits"][0])
    width, height = png_size(screenshot)
    assert width == 900 and height >= 700
    assert len(set(screenshot[100:])) > 16  # something was drawn, not a blank page


def test_the_page_tells_an_error(served):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path(),
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(served.url)
            page.fill("#input", "w " * 1100)  # longer than the model takes: 413
            page.click("#go")
            page.wait_for_selector("#status.error")
            message = page.inner_text("#status")
        finally:
            browser.close()
    assert "--max-source-positions" in message
