"""The built book in a real browser, as a reader meets it, on a network that reaches nothing.

Runs on both editions: the open one (`make book`, or set SITE_HTML) and the class one
(`make book EDITION=class`, or set SITE_CLASS_HTML). SITE_BOOK_ROOT and SITE_TOC point the
tests at another checkout and table of contents; screenshots go to test-artifacts/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import quote, unquote, urlsplit

import pytest
import yaml

from tests.site_support import (
    CHROMIUM_ARGS,
    element_ids,
    ensure_chromium,
    first_heading,
    front_matter,
    serve,
    toc_pages,
)

ROOT = Path(__file__).resolve().parents[1]
BOOK_ROOT = Path(os.environ.get("SITE_BOOK_ROOT", ROOT))
EDITIONS = {"open": Path(os.environ.get("SITE_HTML", BOOK_ROOT / "_build" / "html")),
            # jupyter-book writes into <--path-output>/_build.
            "class": Path(os.environ.get("SITE_CLASS_HTML", BOOK_ROOT / "_build" / "class" / "_build" / "html"))}
TOC = Path(os.environ.get("SITE_TOC", BOOK_ROOT / "_toc.yml"))
ARTIFACTS = ROOT / "test-artifacts"
CONFIG = yaml.safe_load((BOOK_ROOT / "_config.yml").read_text(encoding="utf-8"))

sys.path.insert(0, str(ROOT / "tools"))

pytestmark = pytest.mark.xdist_group("site")  # one browser loads every page once
from book_site import colab_notebook, colab_notebook_path  # noqa: E402

PAGES = toc_pages(TOC)
# A page whose source is missing fails its own tests, not the collection of the whole suite.
SOURCES = {page: source.read_text(encoding="utf-8") if (source := BOOK_ROOT / f"{page}.md").exists() else ""
           for page in PAGES}
EXECUTABLE_PAGES = [page for page in PAGES if "kernelspec" in front_matter(SOURCES[page])]
# The pages Sphinx adds, which a reader reaches from every page.
SITE_PAGES = PAGES + ["genindex", "search"]
# Terms a reader would type, and the page that must come up: every chapter's own title too.
SEARCHES = [("grouped-query", "book/mqa-gqa")] if "book/mqa-gqa" in PAGES else []
SEARCHES += [(title, page) for page in PAGES[1:] if (title := first_heading(SOURCES[page]))]
RAW_TEX = ("$$", "\\(", "\\)", "\\[", "\\begin{")
PAGE_TIMEOUT_MS = 20_000
SCREENSHOT_MAX_HEIGHT = 6000

COLLECT_JS = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = 'eager'; });
  await Promise.all(images.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener('load', done); img.addEventListener('error', done);
  })));
  const math = Array.from(document.querySelectorAll('.math'));
  const skip = 'pre, code, script, style, textarea, mjx-container';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const rawTex = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!parent || parent.closest(skip) || !parent.checkVisibility()) continue;
    if (%(raw_tex)s.some(token => node.textContent.includes(token))) rawTex.push(node.textContent.trim());
  }
  return {
    images: images.map(img => ({src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0})),
    mathElements: math.length,
    untypesetMath: math.filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80)),
    typesetMath: document.querySelectorAll('mjx-container').length,
    mathErrors: Array.from(document.querySelectorAll('mjx-merror'), el => el.textContent),
    rawTex,
    links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
    icons: Array.from(document.querySelectorAll('link[rel~="icon"]'), link => link.href),
  };
}""" % {"raw_tex": json.dumps(RAW_TEX)}


@dataclass
class Visit:
    """What one page load did: every request, every complaint, and what the page shows."""
    url: str
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    page: dict = field(default_factory=dict)


@dataclass
class Site:
    edition: str
    html: Path
    base: str
    context: object
    visits: dict[str, Visit]
    screenshots: dict[str, Path]


def _is_local(url: str, base: str) -> bool:
    return url.startswith(base) or urlsplit(url).scheme in ("data", "blob", "about")


def _visit(context, url: str, base: str, screenshot_path: Callable[[dict], Path | None] = lambda shown: None) -> Visit:
    """Load a page, let MathJax and the images finish, and record what happened."""
    visit = Visit(url)
    page = context.new_page()
    page.on("console", lambda message: message.type == "error" and visit.console_errors.append(
        f"{message.text} ({message.location.get('url')})"))
    page.on("pageerror", lambda error: visit.console_errors.append(f"uncaught: {error}"))
    page.on("request", lambda request: visit.requests.append(request.url))
    page.on("requestfailed", lambda request: _is_local(request.url, base) and visit.failed_requests.append(
        f"{request.url}: {request.failure}"))
    page.on("response", lambda response: response.status >= 400 and visit.failed_requests.append(
        f"{response.url}: HTTP {response.status}"))
    page.goto(url, wait_until="load", timeout=PAGE_TIMEOUT_MS)
    visit.page = page.evaluate(COLLECT_JS)
    page.wait_for_load_state("networkidle", timeout=PAGE_TIMEOUT_MS)  # the fonts MathJax asked for
    if path := screenshot_path(visit.page):  # the top: long enough for a chapter's first equations and figure
        height = min(page.evaluate("document.documentElement.scrollHeight"), SCREENSHOT_MAX_HEIGHT)
        page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": height})
    page.close()
    return visit


def _key_page_screenshot(page: str, shown: dict, taken: dict[str, Path], prefix: str) -> Path | None:
    """The introduction, and the first chapter that has both math and a figure."""
    if page == PAGES[0]:
        name = "intro"
    elif "chapter" not in taken and shown["typesetMath"] and any("/_images/" in i["src"] for i in shown["images"]):
        name = "chapter"
    else:
        return None
    taken[name] = ARTIFACTS / f"{prefix}{name}.png"
    return taken[name]


# The class edition is built by `make test-book`: its pages are checked in that tier.
@pytest.fixture(scope="session", params=[pytest.param(edition, marks=[pytest.mark.book] if edition == "class" else [])
                                         for edition in EDITIONS])
def site(request):
    """Every page of the table of contents, loaded once in headless Chromium from a local server."""
    edition, html = request.param, EDITIONS[request.param]
    if not (html / "index.html").exists():
        pytest.fail(f"no built {edition} edition at {html}: run `make book EDITION={edition}` first", pytrace=False)
    from playwright.sync_api import sync_playwright

    chromium = ensure_chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    prefix = "" if edition == "open" else f"{edition}-"
    with serve(html) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        # A closed network: anything not served by the book's own server is refused, and recorded.
        context.route("**/*", lambda route: route.continue_() if _is_local(route.request.url, base)
                      else route.abort("blockedbyclient"))
        screenshots: dict[str, Path] = {}
        visits = {page: _visit(context, f"{base}{page}.html", base,
                               lambda shown, page=page: _key_page_screenshot(page, shown, screenshots, prefix))
                  for page in SITE_PAGES}
        yield Site(edition, html, base, context, visits, screenshots)
        browser.close()


@pytest.mark.parametrize("page", SITE_PAGES)
def test_page_loads_without_console_errors_or_failed_requests(site, page):
    visit = site.visits[page]
    assert not visit.console_errors, f"{page}: browser console errors:\n" + "\n".join(visit.console_errors)
    assert not visit.failed_requests, f"{page}: failed requests:\n" + "\n".join(visit.failed_requests)
    # Without an icon of its own, a browser asks the server for a /favicon.ico that is not there.
    assert visit.page["icons"], f"{page} names no favicon"


@pytest.mark.parametrize("page", SITE_PAGES)
def test_page_requests_nothing_outside_the_book(site, page):
    outside = [url for url in site.visits[page].requests if not _is_local(url, site.base)]
    assert not outside, f"{page} asks other hosts for:\n" + "\n".join(outside)


@pytest.mark.parametrize("page", SITE_PAGES)
def test_math_is_typeset_by_the_books_own_mathjax(site, page):
    shown = site.visits[page].page
    assert not shown["untypesetMath"], f"{page}: math left as TeX: {shown['untypesetMath']}"
    assert not shown["mathErrors"], f"{page}: MathJax could not typeset: {shown['mathErrors']}"
    assert not shown["rawTex"], f"{page}: TeX delimiters in the visible text: {shown['rawTex']}"


def test_math_is_typeset_somewhere(site):
    """Guards the test above against a build in which nothing is math."""
    typeset = {page: visit.page["typesetMath"] for page, visit in site.visits.items()}
    assert sum(typeset.values()) > 0, typeset


@pytest.mark.parametrize("page", SITE_PAGES)
def test_every_image_loads(site, page):
    broken = [image["src"] for image in site.visits[page].page["images"] if not image["ok"]]
    assert not broken, f"{page}: images that did not load:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", SITE_PAGES)
def test_internal_links_and_anchors_resolve(site, page):
    shown, dead = site.visits[page].page, []
    for link in sorted(set(shown["links"] + shown["icons"])):
        if not link.startswith(site.base):
            continue
        parts = urlsplit(link)
        target = site.html / unquote(parts.path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            dead.append(f"{link}: no such file")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in element_ids(target):
            dead.append(f"{link}: no id {unquote(parts.fragment)!r} in {target.relative_to(site.html)}")
    assert not dead, f"{page}: links that lead nowhere:\n" + "\n".join(dead)


@pytest.mark.parametrize(("term", "page"), SEARCHES)
def test_search_finds_the_chapter(site, term, page):
    browser_page = site.context.new_page()
    browser_page.goto(f"{site.base}search.html?q={quote(term)}", wait_until="load", timeout=PAGE_TIMEOUT_MS)
    # Sphinx's search writes its summary line when it has finished.
    browser_page.wait_for_function("() => document.querySelector('#search-results .search-summary')?.textContent",
                                   timeout=PAGE_TIMEOUT_MS)
    hits = [urlsplit(href).path for href in browser_page.locator("#search-results ul.search li a").evaluate_all(
        "links => links.map(a => a.href)")]
    browser_page.close()
    assert f"/{page}.html" in hits, f"searching {term!r} found {hits}"


ERRATUM_PAGES = [page for page in EXECUTABLE_PAGES if ":class: warning dropdown" in SOURCES[page]]


@pytest.mark.parametrize("page", ERRATUM_PAGES)
def test_erratum_boxes_are_one_titled_line_until_opened(site, page):
    """A reader who never saw the sources reads past the errata: closed, titled, opened by a click."""
    browser_page = site.context.new_page()
    browser_page.goto(f"{site.base}{page}.html", wait_until="load", timeout=PAGE_TIMEOUT_MS)
    boxes = browser_page.locator("div.admonition.warning.dropdown")
    assert boxes.count() == SOURCES[page].count(":class: warning dropdown")
    for title in boxes.locator(".admonition-title").all_inner_texts():
        assert title.startswith("Erratum") and "source 00" in title, f"{page}: an erratum box titled {title!r}"
    box = boxes.first
    title = box.locator(".admonition-title")
    body = box.locator("> :not(.admonition-title)").first
    assert title.is_visible()
    assert not body.is_visible(), f"{page}: the first erratum box is open"
    title.click()
    body.wait_for(state="visible", timeout=PAGE_TIMEOUT_MS)
    browser_page.close()


def _colab_url(page: str) -> str:
    repository = urlsplit(CONFIG["repository"]["url"]).path.strip("/")
    branch = CONFIG["repository"]["branch"]
    return f"https://colab.research.google.com/github/{repository}/blob/{branch}/{colab_notebook_path(page)}"


@pytest.mark.parametrize("page", EXECUTABLE_PAGES)
def test_colab_button_opens_the_chapters_notebook(site, page):
    colab_links = {link for link in site.visits[page].page["links"] if "colab.research.google.com" in link}
    if site.edition == "class":  # no launch buttons: the notebooks hold the graded answers
        assert colab_links == set(), f"{page}: the class edition links to Colab"
        return
    assert CONFIG["repository"]["url"] == "https://github.com/mha-derived/mha-derived"
    assert colab_links == {_colab_url(page)}, f"{page}: Colab button"
    notebook = BOOK_ROOT / colab_notebook_path(page)
    assert notebook.is_file(), f"{notebook} missing: the book build writes it"
    assert notebook.read_text(encoding="utf-8") == colab_notebook(SOURCES[page]), \
        f"{notebook} is older than {page}.md: rebuild the book"
    if (BOOK_ROOT / ".git").exists():
        path = colab_notebook_path(page)
        changed = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=BOOK_ROOT,
                                 capture_output=True, text=True, check=True).stdout
        assert changed == "", f"Colab opens the committed {path}: commit it ({changed.strip()})"


def test_screenshots_of_key_pages(site):
    """Pictures to look at: the introduction, a chapter with math and a figure, and search."""
    site.screenshots["search"] = ARTIFACTS / ("search.png" if site.edition == "open" else f"{site.edition}-search.png")
    _visit(site.context, f"{site.base}search.html?q=attention", site.base, lambda shown: site.screenshots["search"])
    for name, path in site.screenshots.items():
        assert path.stat().st_size > 10_000, f"{name}: {path} is (nearly) blank"
    assert {"intro", "search"} <= set(site.screenshots)
