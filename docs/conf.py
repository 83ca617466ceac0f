"""Sphinx configuration for torchleaf's documentation (``make docs``).

Markdown pages are read by MyST-Parser, the tutorials in ``docs/tutorials``
are executed by sphinx-gallery on every build (so they cannot rot), and the
API reference comes from docstrings (autodoc + napoleon, Google style).
"""

import os
import re
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

project = "torchleaf"
author = "torchleaf contributors"
copyright = "2026, torchleaf contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# errors.md is rendered by guides/troubleshooting.md (generated below);
# design.md and profile.md are pages of the "Design" section, included by
# design/*.md so that they keep their place in the repository.
exclude_patterns = [
    "_build",
    "errors.md",
    "design.md",
    "profile.md",
    "tutorials/README.txt",
    "tutorials/*.py",
    "auto_tutorials/*.ipynb",
    "auto_tutorials/*.py",
    "auto_tutorials/*.zip",
    "auto_tutorials/*.md5",
    "auto_tutorials/*.json",
    "_generated/*",
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "torchleaf"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"navigation_with_keys": True}

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"

# Every tutorial is executed on every build; an exception fails the build.
sphinx_gallery_conf = {
    "examples_dirs": ["tutorials"],
    "gallery_dirs": ["auto_tutorials"],
    "filename_pattern": r"\.py$",
    "abort_on_example_error": True,
    # Every build runs every tutorial, changed or not: they test the library.
    "run_stale_examples": True,
    "only_warn_on_example_error": False,
    "download_all_examples": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    # Tutorials print what they show; a bare last expression (such as
    # torch.manual_seed's generator) is not echoed.
    "capture_repr": (),
    "show_memory": False,
    "plot_gallery": "True",
    "min_reported_time": 0,
}


def _title(message, when):
    """A section title for one error: the start of its message (the text of
    its first `code` span), else of the case's description."""
    m = re.match(r"`([^`]*)`", message)
    text = m.group(1) if m else re.sub(r"`", "", when)
    text = text.split("\\n")[0]  # a message's literal "\n"
    text = re.split(r"(?<=[.:;])\s|\s\(", text)[0].rstrip(".:;")
    if len(text) > 90:
        text = text[:90].rsplit(" ", 1)[0] + " ..."
    return re.sub(r"([\\*_\[\]<>#`|])", r"\\\1", text)


def _troubleshooting_from_errors(app):
    """docs/_generated/errors_entries.md: one section per row of docs/errors.md
    (its case, when it happens, and the message, which says how to fix it),
    then the rest of errors.md as it is. errors.md stays the one source."""
    with open(os.path.join(HERE, "errors.md"), encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    rows, rest, intro, in_table, after = [], [], [], False, False
    for line in lines:
        if line.startswith("| case |"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            rows.append(line)
            continue
        if in_table and not line.startswith("|"):
            in_table, after = False, True
        (rest if after else intro).append(line)
    out = []
    for row in rows:
        # Split on cell separators that are not inside `code`.
        cells, cur, code = [], "", False
        for ch in row.strip().strip("|"):
            if ch == "`":
                code = not code
            if ch == "|" and not code:
                cells.append(cur.strip())
                cur = ""
            else:
                cur += ch
        cells.append(cur.strip())
        if len(cells) != 3:
            raise RuntimeError(f"docs/errors.md: a table row without 3 cells: {row[:80]}")
        case, when, message = cells
        out += [f"### {_title(message, when)}", "", f"**When:** {when}", "",
                f"**Message** (it says how to fix the problem): {message}", "",
                f"**Test case:** {case}", ""]
    os.makedirs(os.path.join(HERE, "_generated"), exist_ok=True)
    body = "\n".join(out) + "\n" + "\n".join(rest).replace("\n## ", "\n## ") + "\n"
    path = os.path.join(HERE, "_generated", "errors_entries.md")
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    if old != body:  # rewrite only on change: Sphinx rebuilds what includes it
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
    intro_path = os.path.join(HERE, "_generated", "errors_intro.md")
    intro_body = "\n".join(l for l in intro if not l.startswith("# ")) + "\n"
    old = open(intro_path, encoding="utf-8").read() if os.path.exists(intro_path) else None
    if old != intro_body:
        with open(intro_path, "w", encoding="utf-8") as f:
            f.write(intro_body)


def setup(app):
    app.connect("builder-inited", _troubleshooting_from_errors)
