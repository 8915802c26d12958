"""Sphinx settings of the course's website: ``make site`` stages the executed notebooks beside this file."""

project = "perflab"
author = "the perflab authors"
html_title = "perflab: PyTorch performance engineering, by measuring"
extensions = ["myst_nb"]
# Every notebook arrives executed (perflab.site runs the lectures, with a cache); labs are shown as handed out.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
nb_mime_priority_overrides = [
    # No widget state is kept: a static page shows each widget's plain-text fallback.
    ("html", "application/vnd.jupyter.widget-view+json", None),
]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_theme_options = {
    "repository_url": "https://github.com/perflab/perflab",
    "repository_branch": "main",
    "path_to_docs": "",
    "use_repository_button": True,
    "launch_buttons": {
        "binderhub_url": "https://mybinder.org",
        "colab_url": "https://colab.research.google.com",
        "notebook_interface": "jupyterlab",
    },
    "show_toc_level": 2,
}
