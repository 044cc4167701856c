"""What the browser tests need around them: a browser, a local web server, the book's pages."""
from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import yaml

from tests import debian_packages

CHROMIUM = Path("/usr/bin/chromium")
# Headless and quiet: no GPU, no QUIC, no first-run pages, no background calls home.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# Debian package -> a file it installs. The Chinese font is for the screenshots: the glossary
# and the sources page quote the Chinese documents, which would otherwise show as empty boxes.
BROWSER_PACKAGES = {"chromium": CHROMIUM, "fonts-wqy-zenhei": Path("/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc")}


def ensure_chromium() -> Path:
    """Debian's chromium, installed with apt on first use (Playwright's own download is not reachable)."""
    missing = [package for package, installed in BROWSER_PACKAGES.items() if not installed.exists()]
    if not missing:
        return CHROMIUM
    debian_packages.install(missing)
    if not CHROMIUM.exists():
        raise RuntimeError(f"apt-get installed chromium but {CHROMIUM} is still missing")
    return CHROMIUM


class _QuietHandler(SimpleHTTPRequestHandler):
    extensions_map = {
        **SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript", ".svg": "image/svg+xml", ".woff": "font/woff", ".woff2": "font/woff2",
    }

    def log_message(self, format: str, *args) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A browser that closes a connection while a file is still being sent (it navigated on) is no error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve a folder on 127.0.0.1 on a free port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = _QuietServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def toc_pages(toc_file: Path) -> list[str]:
    """Every document in a Jupyter Book table of contents, in reading order."""
    toc = yaml.safe_load(toc_file.read_text(encoding="utf-8"))
    pages = [toc["root"]]

    def walk(entries: list[dict]) -> None:
        for entry in entries:
            if "file" in entry:
                pages.append(entry["file"].removesuffix(".md").removesuffix(".ipynb"))
            for key in ("parts", "chapters", "sections"):
                walk(entry.get(key, []))

    walk([toc])
    return pages


def front_matter(markdown: str) -> dict:
    if not markdown.startswith("---"):
        return {}
    return yaml.safe_load(markdown.split("---", 2)[1]) or {}


def first_heading(markdown: str) -> str | None:
    """A page's title as a reader would type it: its words, without math, roles or markup."""
    title = next((line[2:] for line in markdown.splitlines() if line.startswith("# ")), None)
    if title is None:
        return None
    # Sphinx's search splits "PyTorch's" into "PyTorch" and "s", then finds no page with "s".
    words = re.sub(r"\$[^$]*\$|\{[\w:-]+\}|[`*]|['’]s\b", " ", title)
    return " ".join(words.split()) or None


class _IdCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value or "")


@functools.lru_cache(maxsize=None)
def element_ids(html_file: Path) -> frozenset[str]:
    """The ids a #fragment can point at in a built page."""
    collector = _IdCollector()
    collector.feed(html_file.read_text(encoding="utf-8"))
    return frozenset(collector.ids)
