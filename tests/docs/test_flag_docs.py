"""The flag tables of README.md and docs/FLAGS.md are what scripts/gen_flag_docs.py generates from the settings
dataclasses, so a changed default, flag or help text cannot leave the documentation behind."""

from __future__ import annotations

import dataclasses

import pytest

from scripts.gen_flag_docs import README_FLAGS, ROOT, config_classes, regions, render

FIX = "run `.venv/bin/python scripts/gen_flag_docs.py` and commit the result"


@pytest.mark.parametrize("path", list(regions()), ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_tables_are_generated(path):
    current = path.read_text()
    fresh = render(path, current)
    if fresh != current:
        changed = [line for line in fresh.splitlines() if line not in current.splitlines()][:5]
        pytest.fail(
            f"{path.relative_to(ROOT)}: the flag tables differ from the settings dataclasses: {FIX}. "
            f"First generated lines not in the file: {changed}"
        )


def test_every_flag_is_in_the_full_tables():
    flags_doc = (ROOT / "docs" / "FLAGS.md").read_text()
    for binary, cls in config_classes().items():
        section = flags_doc.partition(f"<!-- flags:{binary}:begin -->")[2].partition(f"<!-- flags:{binary}:end -->")[0]
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert f"| `{flag}` |" in section, f"{flag} of mmcast-{binary} is missing from docs/FLAGS.md: {FIX}"


def test_readme_names_only_real_settings():
    classes = config_classes()
    for binary, name, _ in README_FLAGS:
        assert name in {f.name for f in dataclasses.fields(classes[binary])}, (
            f"README_FLAGS: no {binary} setting {name}"
        )


def test_readme_has_no_hand_kept_flag_table():
    """The generated table is the README's only table of flags and defaults."""
    readme = (ROOT / "README.md").read_text()
    outside = readme.replace(
        readme.partition("<!-- flags:readme:begin -->")[2].partition("<!-- flags:readme:end -->")[0], ""
    )
    assert "| flag |" not in outside, f"README.md has a flag table outside the generated region: {FIX}"
