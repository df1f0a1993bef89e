"""The documentation holds together: README's links lead to files, every page is in the site's
nav, the configuration reference lists every key, and the site builds without a warning."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from triax.config import TrainConfig
from triax.config.strict import schema_keys
from support import REPO_DIR

ROOT = Path(REPO_DIR)
DOCS = ROOT / "docs"


def local_links(markdown: str) -> list[str]:
    """Targets of Markdown links and images that are not URLs or in-page anchors, anchor removed."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [target.split("#")[0] for target in targets
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_readme_links_lead_to_files():
    links = local_links((ROOT / "README.md").read_text())
    assert links, "README.md links to no documentation"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; the details belong in docs/"


def nav_pages(items) -> list[str]:
    pages = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav():
    # mkdocs.yml is read as plain YAML: the nav is plain, and no tag in the file needs mkdocs.
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def load_hook():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_lists_every_key_with_its_docstring():
    hook = load_hook()
    reference = hook.config_reference()
    rows = re.findall(r"^\| `([a-z_.]+)` \| `[^`]*` \| (.*) \|$", reference, re.MULTILINE)
    keys = {key for key in schema_keys(TrainConfig) if "." in key}
    groups = {key for key in keys if any(other.startswith(key + ".") for other in keys)}  # model.lora: its keys' rows
    assert {key for key, _ in rows} == keys - groups
    assert all(meaning.strip() for _, meaning in rows), "a config field has no docstring"
    assert "| `trainer.max_steps` | `500` |" in reference
    assert hook.MARKER in (DOCS / "configuration.md").read_text()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with `mkdocs build --strict` (any warning fails the build)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    directory = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return directory


def test_site_builds_without_warnings(site):
    assert (site / "index.html").is_file()


def test_api_pages_list_arguments(site):
    """Google-style `Args:` sections render as a table of parameters (the Accelerator's arguments
    were once one run-on paragraph)."""
    page = (site / "api" / "index.html").read_text()
    accelerator = page[page.index('id="triax.accelerate.Accelerator"'):]
    table = accelerator[accelerator.index("Parameters:"):accelerator.index("</table>")]
    for name in ("device_placement", "mixed_precision", "gradient_accumulation_steps", "log_with", "parallel",
                 "data_order"):
        assert f"<code>{name}</code>" in table, name


def test_configuration_table_keeps_key_names_whole(site):
    page = (site / "configuration" / "index.html").read_text()
    assert "stylesheets/extra.css" in page and "<td><code>trainer.collective_timeout</code></td>" in page
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"td:first-child code \{[^}]*white-space: nowrap", css)


@pytest.mark.multiprocess
def test_readme_python_examples_run(tmp_path):
    """Each door's example in the README is complete: it runs as written, as one process."""
    from triax.testing import quiet_env, run

    examples = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(examples) >= 3, "README.md lost its door examples"
    for number, code in enumerate(examples):
        script = tmp_path / f"example_{number}.py"
        script.write_text(code)
        run([sys.executable, str(script)], timeout=300, cwd=str(tmp_path), env=quiet_env())
