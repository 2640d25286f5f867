"""`polyrl view` in a real browser (Debian's chromium + chromedriver through Selenium; skipped with the reason where
either is missing) over small run directories written here in the trainer's layout (checked against a real
`polyrl train` run: config.yaml, metrics.jsonl, status.json, samples/step_N.{png,jsonl}, samples/grid.json,
eval/<timestamp>/{report.json,eval.json,samples.jsonl,gains.png,losses.png}). Also, without a browser: the server
refuses paths out of its directories, answers only reads, and writes nothing; the state of a run from its files."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

from polyrl.run_files import RunStatus
from polyrl.view.runs import QUIET_SECONDS, run_state, seed_group
from polyrl.view.server import make_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
STEPS, EVAL_EVERY, TILES = 6, 2, 4
COLOURS = {0: (200, 40, 40), 2: (40, 160, 40), 4: (40, 40, 200), 6: (200, 200, 40)}


def write_run(run: Path, seed: int, algorithm: str = "diffusion_nft", alarm_at: int | None = None,
              state: str | None = "finished") -> list[dict]:
    """A run directory as `polyrl train` leaves it (without checkpoints): its metrics rows are returned."""
    run.mkdir(parents=True)
    config = {"name": "toy_shapes", "model": {"name": "sd3", "path": "/models/toy"},
              "algorithm": {"name": algorithm, "num_timesteps": 3}, "reward": {"name": "shapes"},
              "trainer": {"max_steps": STEPS, "seed": seed, "output_dir": str(run), "eval_every": EVAL_EVERY,
                          "progress": False}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [{"step": 0, "eval/reward_mean": 0.5, "time/eval": 1.0}]
    for step in range(1, STEPS + 1):
        row = {"step": step, "reward/mean": 0.5 + 0.03 * step + 0.01 * seed, "loss": 1.0 / step, "grad_norm": 0.2,
               "lr": 4e-4, "time/step": 10.0, "reward_extra/shapes/count_acc": 0.4 + 0.02 * step}
        if step % EVAL_EVERY == 0:
            row.update({"eval/reward_mean": 0.5 + 0.02 * step + 0.01 * seed, "time/eval": 1.0})
            if alarm_at is not None:
                row["eval/hacking_alarm"] = float(step >= alarm_at)
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = run / "samples"
    samples.mkdir()
    prompts = [f"prompt {i}" for i in range(8)]
    (samples / "grid.json").write_text(json.dumps({"step": 0, "tiles": [3, 1, 0, 2], "rewards": [0.1] * TILES}))
    for step, colour in COLOURS.items():
        # grid_image's layout: TILES tiles in one row, each an image over its caption
        Image.new("RGB", (TILES * 32, 48), colour).save(samples / f"step_{step:06d}.png")
        (samples / f"step_{step:06d}.jsonl").write_text("".join(
            json.dumps({"prompt": p, "reward": round(0.1 * i + 0.01 * step, 4)}) + "\n" for i, p in enumerate(prompts)))
    if state is not None:
        status = RunStatus(run, STEPS)
        status.write(state, STEPS if state == "finished" else 3)
    return rows


def write_eval(out: Path) -> dict:
    """An evaluation directory as `polyrl eval ... eval.compare_base=true` leaves it, with two categories."""
    out.mkdir(parents=True)
    s = {"mean": 0.8, "ci95": [0.7, 0.9], "prompts": 4, "samples": 8, "base_mean": 0.75, "base_ci95": [0.65, 0.85],
         "delta": 0.05, "delta_ci95": [-0.01, 0.11], "win_rate": 0.625,
         "categories": {"counting": {"mean": 0.9, "ci95": [0.8, 1.0], "prompts": 2, "samples": 4, "base_mean": 0.7,
                                     "base_ci95": [0.6, 0.8], "delta": 0.2, "delta_ci95": [0.1, 0.3], "win_rate": 0.75},
                        "position": {"mean": 0.7, "ci95": [0.6, 0.8], "prompts": 2, "samples": 4, "base_mean": 0.8,
                                     "base_ci95": [0.7, 0.9], "delta": -0.1, "delta_ci95": [-0.2, 0.0],
                                     "win_rate": 0.5}},
         "category_mean": 0.8, "base_category_mean": 0.75, "category_delta": 0.05}
    spec = {"checkpoint": "runs/toy/checkpoints/step_000006", "model_path": "/models/toy", "data_path": "geneval.jsonl",
            "format": "geneval", "scorers": ["geneval"], "samples_per_prompt": 2, "seed": 0, "compare_base": True,
            "noise_level": 0.0, "total_prompts": 4}
    report = {**spec, "scorers": {"geneval": s}, "prompts": 4, "samples": 8, "seconds": 3.0}
    (out / "eval.json").write_text(json.dumps(spec))
    (out / "report.json").write_text(json.dumps(report))
    (out / "samples.jsonl").write_text("".join(json.dumps({"index": i}) + "\n" for i in range(4)))
    for name in ("gains", "losses"):
        Image.new("RGB", (64, 40), (120, 120, 120)).save(out / f"{name}.png")
    return report


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Three runs (two seeds of one config, and another algorithm whose hacking watch fired at step 4), an
    evaluation of the first, a secret outside the root and a link to it inside; a server over the root."""
    base = tmp_path_factory.mktemp("view")
    root = base / "runs"
    rows = write_run(root / "toy" / "seed0", 0)
    write_run(root / "toy" / "seed1", 1, state="running")  # this process: alive
    write_run(root / "other" / "run", 0, algorithm="flow_grpo", alarm_at=4, state=None)
    report = write_eval(root / "toy" / "seed0" / "eval" / "20261205-120000")
    (base / "secret.json").write_text('{"secret": 1}')
    (root / "toy" / "seed0" / "samples" / "link.json").symlink_to(base / "secret.json")
    server = make_server([root], "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"root": root, "base": base, "port": server.server_address[1], "rows": rows, "report": report}
    server.shutdown()
    server.server_close()


def _get(port: int, path: str, method: str = "GET", host: str | None = None) -> tuple[int, bytes]:
    """A raw request: `path` goes out byte for byte (no client-side normalising of `..`)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", host or f"127.0.0.1:{port}")
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_serves_only_files_under_its_directories(site):
    port = site["port"]
    status, body = _get(port, "/files/0/toy/seed0/samples/step_000002.png")
    assert status == 200 and body[:8] == b"\x89PNG\r\n\x1a\n"
    assert _get(port, "/files/0/toy/seed0/config.yaml")[0] == 200
    for attempt in ("/files/0/../secret.json", "/files/0/toy/../../secret.json", "/files/0/%2e%2e/secret.json",
                    "/files/0/toy/%2E%2E/%2e%2e/secret.json", "/files/0/toy/..%2f..%2fsecret.json",
                    "/files/0/..%5csecret.json", "/files/0/toy/seed0/samples/link.json", "/files/0//etc/passwd",
                    "/files/0/%00", "/files/1/secret.json", "/files/../secret.json", "/files/0/%252e%252e/secret.json",
                    "/files/0/toy/seed0/checkpoints/step_000006/trainer_state.pt", "/../secret.json",
                    "/api/metrics?run=0/../..", "/api/samples?run=0/toy/seed0/../../.."):
        status, body = _get(port, attempt)
        assert status in (403, 404), attempt
        assert b"secret" not in body, attempt
    assert _get(port, "/files/0/%2e%2e/secret.json")[0] == 403  # decoded once: `..` is refused, not just missing
    assert _get(port, "/files/0/toy/seed0/samples/link.json")[0] == 403  # the link points out of the root
    assert _get(port, "/api/runs", method="POST")[0] == 405
    assert _get(port, "/api/runs", host="evil.example:80")[0] == 403  # DNS rebinding: another name for this host
    assert _get(port, "/api/runs", host=f"localhost:{port}")[0] == 200


def test_the_api_reads_the_runs(site):
    status, body = _get(site["port"], "/api/runs")
    data = json.loads(body)
    runs = {r["id"]: r for r in data["runs"]}
    assert sorted(runs) == ["0/other/run", "0/toy/seed0", "0/toy/seed1"]
    a, b, c = runs["0/toy/seed0"], runs["0/toy/seed1"], runs["0/other/run"]
    assert (a["state"], b["state"]) == ("finished", "running")
    assert c["state"] == "finished"  # no status.json (an older version's run): its metrics reached max_steps
    assert a["group"] == b["group"] != c["group"]  # seeds 0 and 1 differ only in trainer.seed
    assert (a["step"], a["max_steps"], a["wall_seconds"]) == (STEPS, STEPS, STEPS * 10.0 + 4 * 1.0)
    assert c["alarms"] == [4, 6] and a["alarms"] == []
    assert a["sample_steps"] == [0, 2, 4, 6]
    assert [e["id"] for e in data["evals"]] == ["0/toy/seed0/eval/20261205-120000"]
    assert data["evals"][0]["run"] == "0/toy/seed0" and data["evals"][0]["media"] == ["gains.png", "losses.png"]
    metrics = json.loads(_get(site["port"], "/api/metrics?run=0/toy/seed0")[1])
    assert metrics["rows"] == site["rows"]


def test_run_state_from_its_files():
    now = 1_000_000.0
    here = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has ended
    assert run_state({"state": "finished"}, 6, 6, now, now) == ("finished", "")
    assert run_state({"state": "stopped", "error": "RunStopped: stopped by SIGTERM"}, 3, 6, now, now)[0] == "stopped"
    assert run_state({"state": "running", "host": here, "pid": os.getpid()}, 3, 6, now, now) == ("running", "")
    assert run_state({"state": "running", "host": here, "pid": dead}, 3, 6, now, now)[0] == "failed"
    assert run_state({"state": "running", "host": "elsewhere", "pid": dead}, 3, 6, now, now) == ("running", "on elsewhere")
    # a run of an older version (no status.json): from its metrics
    assert run_state(None, 6, 6, now - 10 * QUIET_SECONDS, now)[0] == "finished"
    assert run_state(None, 3, 6, now - 60, now)[0] == "running"
    assert run_state(None, 3, 6, now - 2 * QUIET_SECONDS, now)[0] == "stopped"
    assert seed_group({"trainer": {"seed": 0, "lr": 1}}) == seed_group({"trainer": {"seed": 1, "lr": 1}})
    assert seed_group({"trainer": {"seed": 0, "lr": 1}}) != seed_group({"trainer": {"seed": 0, "lr": 2}})


def test_the_view_imports_no_model_code():
    code = ("import sys; import polyrl.view.server, polyrl.cli.view; "
            "bad = [m for m in ('torch', 'polyrl.trainer', 'polyrl.models', 'diffusers') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------- the browser
def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} not found (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = _browser_missing()
    if missing:
        pytest.skip(f"no browser: {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def _wait(driver, condition, what: str, timeout: float = 15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(condition)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _count(driver, css: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", css)


def test_the_page_in_a_browser(site, browser):
    before = _tree(site["root"])
    d = browser
    d.get(f"http://127.0.0.1:{site['port']}/?poll=300")
    _wait(d, "return Number(document.body.dataset.refreshes) >= 1", "the first refresh")
    assert d.execute_script("return document.getElementById('refreshed').textContent").startswith("updated")
    # the runs, their state and the alarm
    labels = d.execute_script("return [...document.querySelectorAll('tr.run')].map(r => r.dataset.run)")
    assert labels == ["0/other/run", "0/toy/seed0", "0/toy/seed1"]
    state = d.execute_script("return document.querySelector('tr.run[data-run=\"0/toy/seed0\"] .state span').textContent")
    assert state == "finished"
    assert "alarm at step 4, 6" in d.execute_script(
        "return document.querySelector('tr.run[data-run=\"0/other/run\"] .alarms').textContent")

    # bands on (the default): seeds 0 and 1 are one mean with a band, the other run a line of its own
    chart = "svg.chart[data-key='reward/mean']"
    assert _count(d, f"{chart} g.series") == 2
    assert _count(d, f"{chart} g.series[data-kind='band'] path.band") == 1
    assert _count(d, f"{chart} g.series[data-kind='band'] circle.pt") == STEPS
    assert _count(d, f"{chart} line.alarm") == 2  # the other run's alarms at steps 4 and 6
    # bands off: every run overlaid, each with one point per logged step
    d.find_element("id", "band-toggle").click()
    assert _count(d, f"{chart} g.series") == 3 and _count(d, f"{chart} path.band") == 0
    logged = sum(1 for r in site["rows"] if "reward/mean" in r)
    assert _count(d, f"{chart} g.series[data-run='0/toy/seed0'] circle.pt") == logged == STEPS
    evals = sum(1 for r in site["rows"] if "eval/reward_mean" in r)
    assert _count(d, "svg.chart[data-key='eval/reward_mean'] g.series[data-run='0/toy/seed0'] circle.pt") == evals
    assert _count(d, "svg.chart[data-key='reward_extra/shapes/count_acc']") == 1

    # held-out samples: the slider moves through the evaluations and the grid follows
    d.execute_script("document.getElementById('sample-run').value = '0/toy/seed0';"
                     "document.getElementById('sample-run').dispatchEvent(new Event('change'))")
    _wait(d, "return (document.getElementById('grid-img') || {}).src?.includes('/toy/seed0/samples/step_000006.png')",
          "the last evaluation's grid of seed 0")
    slider = d.find_element("id", "step-slider")
    assert (slider.get_attribute("max"), slider.get_attribute("value")) == ("3", "3")
    d.execute_script("const s = document.getElementById('step-slider'); s.value = 1;"
                     "s.dispatchEvent(new Event('input'))")
    assert d.find_element("id", "grid-img").get_attribute("src").endswith("/files/0/toy/seed0/samples/step_000002.png")
    assert "step 2 (evaluation 2 of 4)" in d.find_element("id", "step-label").text
    _wait(d, "const i = document.getElementById('grid-img'); return i.complete && i.naturalWidth === 128",
          "the grid image to load")
    # one prompt across the evaluations: tile 1 is sample 3 of each step (grid.json), cropped from each grid
    assert d.execute_script("return document.getElementById('follow').options[0].textContent") == "tile 1: prompt 3"
    _wait(d, "return [...document.querySelectorAll('#follow-strip canvas')].every(c => c.dataset.loaded)"
             " && document.querySelectorAll('#follow-strip canvas').length === 4", "the followed prompt's crops")
    pixel = d.execute_script("const c = document.querySelector('#follow-strip canvas[data-step=\"4\"]');"
                             "return [...c.getContext('2d').getImageData(2, 2, 1, 1).data].slice(0, 3)")
    assert pixel == list(COLOURS[4])
    captions = d.execute_script("return [...document.querySelectorAll('#follow-strip figcaption')].map(f => f.textContent)")
    assert captions == ["step 0: r=0.300", "step 2: r=0.320", "step 4: r=0.340", "step 6: r=0.360"]

    # the evaluation report's table
    rows = d.execute_script("return [...document.querySelectorAll('table.eval-report tr')].map("
                            "r => [...r.children].map(c => c.textContent))")
    assert rows[0] == ["scorer", "mean", "ci95", "base", "delta", "delta ci95", "win rate"]
    assert rows[1] == ["geneval", "0.8000", "[0.7000, 0.9000]", "0.7500", "+0.0500", "[-0.0100, 0.1100]", "0.625"]
    assert rows[2][0] == "counting" and rows[2][4] == "+0.2000" and rows[3][4] == "-0.1000"
    assert _count(d, "img.eval-grid") == 2
    _wait(d, "return [...document.querySelectorAll('img.eval-grid')].every(i => i.complete && i.naturalWidth === 64)",
          "the gains and losses grids")
    assert _tree(site["root"]) == before  # the page read, nothing was written

    # a run that goes on: a new metrics line and a new evaluation appear without reloading the page
    run = site["root"] / "toy" / "seed0"
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": STEPS + 1, "reward/mean": 0.9, "loss": 0.1}) + "\n")
    Image.new("RGB", (TILES * 32, 48), (0, 0, 0)).save(run / "samples" / "step_000008.png")
    _wait(d, f"return document.querySelectorAll(\"{chart} g.series[data-run='0/toy/seed0'] circle.pt\").length"
             f" === {STEPS + 1}", "the new step on the curve")
    _wait(d, "return document.getElementById('step-slider').max === '4'", "the new evaluation on the slider")
    console = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not console, console
