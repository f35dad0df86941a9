"""Sphinx configuration of matepoint's documentation (make docs)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "matepoint"
author = "matepoint developers"
copyright = "matepoint developers, MIT license"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "matepoint_options",   # the options page, from the C core's table (_ext/)
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "requirements.txt", "_generated", "_screenshots"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "matepoint"
# everything the pages load ships with the site: it works offline
html_static_path = []
