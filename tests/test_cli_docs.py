"""The CLI's lists (models, rewards, algorithms, recipes, bench workloads) against the docs' tables, and the help
texts against the code: whichever moves first, this test names what the other lacks."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def table_names(doc: str, header: str) -> set[str]:
    """The backticked names in the first column of the table in docs/<doc> whose first header cell is `header`
    (a cell such as "`jpeg_compressibility` / `jpeg_incompressibility`" gives both)."""
    names, inside = set(), False
    for line in (DOCS / doc).read_text().splitlines():
        if not line.startswith("|"):
            if inside:
                break
            continue
        first = line.strip("|").split("|")[0].strip()
        if not inside:
            inside = first == header
            continue
        if set(first) <= set("-: "):
            continue
        names |= set(re.findall(r"`([^`]+)`", first))
    assert names, f"no table headed {header!r} in docs/{doc}"
    return names


def test_models_and_recipes_match_docs_recipes_md():
    from polyrl.config import group_options

    assert set(group_options("model")) == table_names("recipes.md", "`model=`")
    assert set(group_options("recipe")) == table_names("recipes.md", "`recipe=`")


def test_building_blocks_compose_but_are_not_offered_as_recipes():
    from polyrl.config import CONFIG_DIR, group_options, is_building_block, load_config, train_help

    blocks = {p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml") if is_building_block(p)}
    assert blocks == {"toy_common", "toy_motion_common", "toy_ocr_common", "sd35m_flowgrpo_bench"}
    assert not blocks & set(group_options("recipe"))
    recipes_line = " ".join(re.findall(r"^  recipe +(.*(?:\n {22}.*)*)", train_help(), re.M))
    offered = set(re.split(r"[,\s]+", recipes_line.strip()))
    assert offered == set(group_options("recipe")) and "toy_shapes" in offered
    assert load_config(["recipe=toy_common"]).name == "toy_common"  # still usable where docs/algorithms.md says so


def test_algorithms_match_docs():
    from polyrl.config import group_options

    documented = table_names("algorithms.md", "`algorithm=`") | table_names("tokens.md", "`algorithm=`")
    assert set(group_options("algorithm")) == documented


def test_rewards_match_docs():
    """Every shipped reward (a YAML in config/reward or a class registered by polyrl's own modules; a reward another
    test registered from its own file does not count) has a row in docs/rewards.md or docs/tokens.md."""
    from polyrl.config import CONFIG_DIR
    from polyrl.rewards import REWARDS

    shipped = {p.stem for p in (CONFIG_DIR / "reward").glob("*.yaml")}
    shipped |= {name for name, cls in REWARDS.items() if cls.__module__.startswith("polyrl.")}
    assert shipped == table_names("rewards.md", "`reward=`") | table_names("tokens.md", "`reward=`")


def test_bench_workloads_match_help_and_docs():
    from polyrl.cli.bench import WORKLOADS
    from polyrl.cli.main import USAGE

    in_help = set(re.search(r"polyrl bench .*--workload ([\w|]+)", USAGE).group(1).split("|"))
    assert set(WORKLOADS) == in_help == table_names("performance.md", "`--workload`")


def test_help_promises_what_the_code_does():
    from polyrl.cli.main import USAGE
    from polyrl.cli.pretrain_toy import DEFAULTS
    from polyrl.config import train_help

    assert set(re.search(r"pretrain-toy \[--task ([\w|]+)\]", USAGE).group(1).split("|")) == set(DEFAULTS)
    # the default run measured alone on 2 cores: 256 s
    text = train_help()
    assert "about 4-5 minutes on 2 CPU cores" in text and "9 minutes" not in text
