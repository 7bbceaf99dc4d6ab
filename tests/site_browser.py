"""Open the built site in headless Debian chromium and report what a reader would see.

Support module for tests/test_site.py (no tests here). ``check_pages`` serves a built
``_build/html`` on 127.0.0.1 (a free port, in a thread), opens each page in
``/usr/bin/chromium`` driven by Playwright (the pip wheel brings its own node driver; no
browser is downloaded), and returns one ``PageReport`` per page: title, code blocks,
captured-output blocks, copy buttons, what each copy button really copies, console errors,
uncaught exceptions, failed requests, and a screenshot of what the reader sees first.

    from site_browser import check_pages
    reports = check_pages(HTML, ["index.html", "recipes/save_load_recipe.html"],
                          ROOT / "_build" / "screenshots")
    for report in reports:
        assert not report.errors, report.summary()

Requests to any host but the local server are blocked (network or not, nothing leaves the
machine) and listed in ``external_requests`` (and, with why each failed, in
``blocked_requests``); the page's reaction to the block shows up in ``console_errors``. So a
theme that loads fonts, analytics or scripts from the internet is caught here, on a machine
without a network and on a CI runner with one.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import tempfile
import threading
import time
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import sync_playwright

# Debian's chromium (`make browser-deps`); GitHub's Ubuntu images put their own there too.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless chromium on a closed network, run as root: no sandbox, no GPU, and none of the
# background connections (updates, sync, QUIC probes) that fail loudly without a network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Every request to another host goes to a proxy on a closed loopback port (loopback itself
    # bypasses proxies): it fails at once and never leaves the machine. Blocking them through
    # Playwright's request interception instead would turn the browser's cache off: each page
    # fetched and compiled the theme's scripts and styles again (a sixth of the check's time).
    "--proxy-server=socks5://127.0.0.1:9",
]
VIEWPORT = {"width": 1280, "height": 900}  # a laptop's screen, as a reader reads
PAGE_TIMEOUT_MS = 30_000
# A cold start reads chromium (about 350 MB) from disk: under a busy disk that took over 30 s.
LAUNCH_TIMEOUT_MS = 120_000
# After "load", wait until the network has been quiet for 500 ms (async scripts, fonts),
# but not longer than this: a page that keeps polling must not stall the test.
SETTLE_TIMEOUT_MS = 5_000

# Code blocks are highlighted <pre>s outside Sphinx-Gallery's captured output.
INSPECT_JS = """
() => {
  const isOutput = (el) => el.closest("div.sphx-glr-script-out") !== null;
  const blocks = [...document.querySelectorAll("div.highlight")];
  const code = blocks.filter((b) => !isOutput(b));
  const outputs = [...document.querySelectorAll("div.sphx-glr-script-out")];
  const h1 = document.querySelector("h1");
  return {
    title: document.title,
    h1: h1 ? h1.innerText.replace(/\\s*#\\s*$/, "").trim() : "",
    code_blocks: code.length,
    code_blocks_with_copy_button: code.filter((b) => b.querySelector("button.copybtn")).length,
    output_blocks: outputs.length,
    output_blocks_with_copy_button: outputs.filter((o) => o.querySelector("button.copybtn")).length,
    run_stamp: (document.querySelector("div.dcp-run-stamp") || {}).innerText || "",
    // The header's brand: the site's own name, as the theme styles it, and no logo image.
    brand: (() => {
      // The header has it twice (the wide navbar, the narrow screen's drawer): the shown one.
      const brands = [...document.querySelectorAll("a.navbar-brand")];
      const brand = brands.find((b) => b.offsetHeight > 0) || brands[0] || null;
      if (brand === null) return {text: "", images: 0, visible: false, href: ""};
      return {text: brand.innerText.trim(), images: brand.querySelectorAll("img").length,
              visible: brand.offsetHeight > 0 && brand.offsetWidth > 0,
              href: brand.getAttribute("href")};
    })(),
    footer_visible: (() => {
      const footer = document.querySelector("footer.dcp-footer");
      return footer !== null && footer.offsetHeight > 0;
    })(),
    cookie_banners: [...document.querySelectorAll("[class*=cookie], [id*=cookie]")].filter(
      (el) => el.offsetParent !== null).length,
    header_links: [...document.querySelectorAll("div.dcp-page-links a[href]")].map(
      (a) => [a.innerText.trim(), a.href]),
    // Output blocks and result tables wider than the column: the reader scrolls sideways.
    overflowing: [...document.querySelectorAll(
      "div.sphx-glr-script-out pre, table.dcp-results")].filter(
      (el) => el.scrollWidth > (el.tagName === "TABLE" ? el.parentElement : el).clientWidth + 1
    ).map((el) => `${el.tagName.toLowerCase()} ${el.scrollWidth}px: ` +
      el.innerText.split("\\n").sort((a, b) => b.length - a.length)[0].slice(0, 80)),
  };
}
"""
# The copy buttons of code blocks (not of captured output), in page order.
CODE_COPY_BUTTONS = "div.highlight:not(div.sphx-glr-script-out div.highlight) button.copybtn"
# What each code block should copy: its text without line numbers, prompts and printed
# output (the spans conf.py's copybutton_exclude names).
EXPECTED_COPIES_JS = """
(selector) => [...document.querySelectorAll(selector)].map((button) => {
  const clone = button.closest("div.highlight").querySelector("pre").cloneNode(true);
  clone.querySelectorAll(".linenos, .gp, .go").forEach((el) => el.remove());
  return clone.textContent;
})
"""
CLEAR_CLIPBOARD_JS = """
async () => {
  window.__copied = [];
  try { await navigator.clipboard.writeText(""); } catch (e) {}
}
"""
# Every text put on the clipboard by a copy command (sphinx-copybutton uses clipboard.js,
# which selects a hidden textarea and runs execCommand("copy")), as a second witness next
# to reading the clipboard itself.
RECORD_COPIES_JS = """
window.__copied = [];
document.addEventListener("copy", () => {
  window.__copied.push(String(document.getSelection()));
}, true);
"""


@dataclass
class CopyCheck:
    """One click on a code block's copy button."""

    block: int  # index among the page's code blocks that have a copy button
    expected: str  # the code block's text without prompts and output
    copied: str  # what the clipboard held after the click
    source: str  # "clipboard" (navigator.clipboard.readText) or "copy-event" (fallback)

    @property
    def ok(self) -> bool:
        return self.copied.rstrip("\n") == self.expected.rstrip("\n") and bool(self.copied.strip())


@dataclass
class PageReport:
    page: str  # relative to the html dir, e.g. "recipes/save_load_recipe.html"
    url: str
    status: int | None  # HTTP status of the page itself
    title: str  # document.title
    h1: str  # the page's first heading
    code_blocks: int
    code_blocks_with_copy_button: int
    output_blocks: int  # Sphinx-Gallery's captured output (div.sphx-glr-script-out)
    output_blocks_with_copy_button: int  # should be 0: output is not for copying
    run_stamp: str  # text of the "Last executed" box, "" where there is none
    cookie_banners: int  # visible elements with "cookie" in their class or id: should be 0
    footer_visible: bool  # the site's own footer is on screen at the bottom of the page
    # The header's brand: {"text", "images", "visible", "href"}: this site's name, no logo.
    brand: dict = field(default_factory=dict)
    # The links under a recipe's title (download script, notebook, view source), with the
    # HTTP status each one answered when the browser fetched it.
    header_links: list = field(default_factory=list)
    # Output blocks and result tables wider than their column, with their widest line.
    overflowing: list = field(default_factory=list)
    copies: list[CopyCheck] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    console_warnings: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)  # uncaught exceptions
    failed_requests: list[str] = field(default_factory=list)  # "URL: reason", 4xx/5xx too
    # Requests to any host but the local server (fonts, analytics, CDNs): blocked, and listed
    # here, so the check does not depend on whether the machine has a network.
    external_requests: list[str] = field(default_factory=list)
    blocked_requests: list[str] = field(default_factory=list)  # "URL: why it failed"
    screenshot: Path | None = None
    seconds: float = 0.0

    @property
    def has_code(self) -> bool:
        return self.code_blocks > 0

    @property
    def has_output(self) -> bool:
        return self.output_blocks > 0

    @property
    def has_copy_button(self) -> bool:
        """Every code block has its copy button (and there is at least one code block)."""
        return self.code_blocks > 0 and self.code_blocks_with_copy_button == self.code_blocks

    @property
    def copies_ok(self) -> bool:
        """Every copy button copied exactly its code block's code."""
        return bool(self.copies) and all(c.ok for c in self.copies)

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed requests: all should be empty."""
        return (
            [f"console: {e}" for e in self.console_errors]
            + [f"exception: {e}" for e in self.page_errors]
            + [f"request: {e}" for e in self.failed_requests]
            + [f"external: {e}" for e in self.external_requests]
        )

    def summary(self) -> str:
        lines = [
            f"{self.page} ({self.status}): title {self.title!r}, h1 {self.h1!r}",
            f"  code blocks {self.code_blocks}"
            f" (copy button on {self.code_blocks_with_copy_button}),"
            f" output blocks {self.output_blocks}"
            f" (copy button on {self.output_blocks_with_copy_button})",
            f"  copies: {sum(c.ok for c in self.copies)}/{len(self.copies)} exact"
            + (f" via {self.copies[0].source}" if self.copies else ""),
            f"  screenshot {self.screenshot}, {self.seconds:.1f} s",
            f"  brand {self.brand}, cookie banners {self.cookie_banners},"
            f" footer visible {self.footer_visible},"
            f" header links {self.header_links}",
            f"  overflowing sideways: {self.overflowing}",
        ]
        for check in self.copies:
            if not check.ok:
                lines.append(f"  copy {check.block}: copied {check.copied[:200]!r}")
                lines.append(f"           expected {check.expected[:200]!r}")
        lines += [f"  {e}" for e in self.errors]
        return "\n".join(lines)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@contextmanager
def serve(html_dir: Path) -> Iterator[str]:
    """Serve ``html_dir`` on 127.0.0.1 at a free port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="site-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def check_pages(
    html_dir: Path,
    pages: list[str],
    screenshot_dir: Path,
    *,
    check_copy: bool = True,
    every_copy_on: Container[str] | None = None,
) -> list[PageReport]:
    """Open each page (relative to ``html_dir``) and report on it.

    Screenshots go to ``screenshot_dir/<page without .html>.png`` (for example
    ``screenshots/recipes/save_load_recipe.png``). With ``check_copy`` every copy button on
    a code block is clicked and what it put on the clipboard is recorded; with
    ``every_copy_on``, every button on those pages and the first and last elsewhere (one
    script and one configuration serve every button: a click costs a tenth of a second).
    """
    html_dir = Path(html_dir)
    screenshot_dir = Path(screenshot_dir)
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: `make browser-deps` installs chromium")
    missing = [page for page in pages if not (html_dir / page).is_file()]
    if missing:
        raise FileNotFoundError(f"not in {html_dir}: {missing}")

    profile = tempfile.mkdtemp(prefix="dcp-site-chromium-")
    try:
        with serve(html_dir) as base, sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport=VIEWPORT,
                # Lets the page read back what a copy button put on the clipboard.
                permissions=["clipboard-read", "clipboard-write"],
                timeout=LAUNCH_TIMEOUT_MS,
            )
            try:
                browser.add_init_script(RECORD_COPIES_JS)
                return [
                    _check_page(
                        browser,
                        base,
                        page,
                        screenshot_dir,
                        check_copy,
                        every_copy=every_copy_on is None or page in every_copy_on,
                    )
                    for page in pages
                ]
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


class _PageEvents:
    """What a page logs and requests while it loads and while it is checked."""

    def __init__(self, page, base: str):
        self.base = base
        self.console_errors: list[str] = []
        self.console_warnings: list[str] = []
        self.page_errors: list[str] = []
        self.failed_requests: list[str] = []
        self.external_requests: list[str] = []
        self.blocked_requests: list[str] = []
        page.on("console", self.on_console)
        page.on(
            "pageerror", lambda error: self.page_errors.append(f"{error.name}: {error.message}")
        )
        page.on("request", self.on_request)
        page.on("requestfailed", self.on_request_failed)
        page.on("response", self.on_response)

    def local(self, url: str) -> bool:
        return url.startswith((self.base, "data:", "blob:"))

    def on_console(self, message) -> None:
        where = (message.location or {}).get("url", "")
        text = f"{message.text} ({where})" if where and where not in message.text else message.text
        if message.type == "error":
            self.console_errors.append(text)
        elif message.type == "warning":
            self.console_warnings.append(text)

    def on_request(self, request) -> None:
        if not self.local(request.url):
            self.external_requests.append(request.url)

    def on_request_failed(self, request) -> None:
        if self.local(request.url):
            self.failed_requests.append(f"{request.url}: {request.failure}")
        else:  # listed in external_requests already
            self.blocked_requests.append(f"{request.url}: {request.failure}")

    def on_response(self, response) -> None:
        if response.status >= 400:
            self.failed_requests.append(f"{response.url}: HTTP {response.status}")

    def fields(self) -> dict:
        names = ("console_errors", "console_warnings", "page_errors", "failed_requests")
        names += ("external_requests", "blocked_requests")
        return {name: getattr(self, name) for name in names}


def _check_page(
    browser, base: str, page_path: str, screenshot_dir: Path, check_copy: bool, every_copy: bool
):
    start = time.perf_counter()
    page = browser.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    events = _PageEvents(page, base)
    try:
        url = base + page_path
        response = page.goto(url, wait_until="load")
        with contextlib.suppress(PlaywrightTimeoutError):  # a page that never goes quiet
            page.wait_for_load_state("networkidle", timeout=SETTLE_TIMEOUT_MS)
        facts = page.evaluate(INSPECT_JS)
        facts["header_links"] = [
            (text, href, page.request.get(href).status) for text, href in facts["header_links"]
        ]
        screenshot = screenshot_dir / Path(page_path).with_suffix(".png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        # The first screen only: a whole page costs a second or more each to encode.
        page.screenshot(path=str(screenshot))  # before any "Copied!" tooltip
        copies = _check_copy_buttons(page, every_copy) if check_copy else []
        return PageReport(
            page=page_path,
            url=url,
            status=response.status if response else None,
            copies=copies,
            screenshot=screenshot,
            seconds=time.perf_counter() - start,
            **facts,
            **events.fields(),
        )
    finally:
        page.close()


def _check_copy_buttons(page, every: bool = True) -> list[CopyCheck]:
    """Click each code block's copy button (or the first and the last only, unless
    ``every``); return what each copied next to what it should."""
    buttons = page.query_selector_all(CODE_COPY_BUTTONS)
    expected = page.evaluate(EXPECTED_COPIES_JS, CODE_COPY_BUTTONS)
    assert len(expected) == len(buttons), "the page changed while it was checked"
    clicked = range(len(buttons)) if every else sorted({0, len(buttons) - 1} - {-1})
    checks = []
    for index in clicked:
        button, want = buttons[index], expected[index]
        page.evaluate(CLEAR_CLIPBOARD_JS)
        # A real (trusted) click: copying needs a user gesture. force=True skips Playwright's
        # wait for the button to be stable and unobscured (the sticky header may cover it).
        button.click(force=True)
        page.wait_for_function("window.__copied.length > 0", timeout=5_000)
        source = "clipboard"
        try:
            copied = page.evaluate("navigator.clipboard.readText()")
        except PlaywrightError:  # no clipboard access in this browser: use the copy event
            copied = ""
        if not copied:
            source = "copy-event"
            copied = page.evaluate("window.__copied[window.__copied.length - 1]")
        checks.append(CopyCheck(block=index, expected=want, copied=copied, source=source))
    return checks
