"""The page at GET / in headless Chromium: a chat message streams a reply
with tokens/s shown, the engine view fills in, and the screenshot holds the
block map's colors (checked by decoding the PNG)."""

from __future__ import annotations

import io
import shutil
import tempfile

import pytest

from server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The page's CSS colors (RGB): KV block states and the batch chart.
FREE = (229, 231, 235)
CACHED = (22, 163, 74)
IN_USE = (37, 99, 235)
PREFILL = (249, 115, 22)
DECODE = (14, 165, 233)

sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
Image = pytest.importorskip("PIL.Image")
if not shutil.which("chromium") and not shutil.os.path.exists(CHROMIUM):
    pytest.skip("Debian's chromium is not installed (scripts/test.sh installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4") as s:
        yield s


def count_color(image, rgb, tolerance: int = 6) -> int:
    r0, g0, b0 = rgb
    return sum(n for n, (r, g, b) in image.getcolors(maxcolors=1 << 20)
               if abs(r - r0) <= tolerance and abs(g - g0) <= tolerance and abs(b - b0) <= tolerance)


def test_chat_streams_and_the_engine_view_shows_the_block_map(server, tmp_path):
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1280, "height": 900})
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('health').textContent.includes('serving')",
                                   timeout=30000)
            page.fill("#max-tokens", "24")
            page.fill("#temperature", "0")
            page.fill("#prompt", "Write one sentence about the sea.")
            page.click("#send")
            page.wait_for_function("document.querySelector('.msg.assistant') && "
                                   "document.querySelector('.msg.assistant').textContent.trim().length > 0",
                                   timeout=120000)
            page.wait_for_function("!document.getElementById('send').disabled", timeout=120000)
            page.wait_for_function("Number(document.getElementById('c-steps').textContent) > 0 && "
                                   "document.getElementById('c-running').textContent === '0'", timeout=30000)
            page.wait_for_timeout(500)  # one more poll paints the block map after the request finished
            speed = page.inner_text("#speed")
            reply = page.inner_text(".msg.assistant")
            png = page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert "tokens/s" in speed and "error" not in reply
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert len(image.getcolors(maxcolors=1 << 20)) > 50, "the screenshot looks blank"
    # after the reply, its blocks stay cached for prefix reuse; the rest of the pool is free
    assert count_color(image, CACHED) > 20 and count_color(image, FREE) > 1000
    assert count_color(image, PREFILL) > 0 and count_color(image, DECODE) > 0


def test_a_failed_message_is_marked_and_can_be_retried(server):
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1280, "height": 900})
        try:
            page = browser.new_page()
            errors, bodies = [], []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.on("request", lambda r: bodies.append(r.post_data) if r.url.endswith("/chat/completions") else None)
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('temperature').placeholder !== ''", timeout=30000)
            # the API key's placeholder fits its box
            fits = page.evaluate("""() => {
                const input = document.getElementById('api-key'), style = getComputedStyle(input);
                const g = document.createElement('canvas').getContext('2d');
                g.font = `${style.fontSize} ${style.fontFamily}`;
                const room = input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
                return g.measureText(input.placeholder).width <= room; }""")
            temperature = page.evaluate("[document.getElementById('temperature').value, "
                                        "document.getElementById('temperature').placeholder]")
            page.fill("#max-tokens", "100000")  # more than max_model_len: the server refuses it
            page.fill("#prompt", "Say hi.")
            page.click("#send")
            page.wait_for_selector(".msg.error .retry", timeout=60000)
            failed = page.evaluate("[document.querySelectorAll('.msg.user.failed').length, "
                                   "document.querySelector('.msg.error').textContent]")
            page.fill("#max-tokens", "6")
            page.click(".msg.error .retry")
            page.wait_for_function("document.querySelector('.msg.assistant') && "
                                   "document.querySelector('.msg.assistant').textContent.trim().length > 0 && "
                                   "!document.getElementById('send').disabled", timeout=120000)
            after = page.evaluate("[document.querySelectorAll('.msg.user').length, "
                                  "document.querySelectorAll('.msg.user.failed').length, "
                                  "document.querySelectorAll('.msg.error').length]")
        finally:
            browser.close()
    defaults = server.engine_state()["default_sampling"]
    assert errors == [] and fits
    assert temperature == ["", str(defaults["temperature"])]  # empty: the model's default, shown
    assert all('"temperature"' not in body for body in bodies)
    assert failed[0] == 1 and "max_model_len" in failed[1]
    assert after == [1, 0, 0]  # the retried message, sent once, and no error left
