"""Plots and the HTML report of a real (tiny) GRPO run; a headless Chromium test of the page."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import length_reward, make_config, standard_dataset

from posttrain import GRPOTrainer
from posttrain.observe import plots, report
from posttrain.observe.plots import main_plot, write_plots
from posttrain.observe.report import main_report, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
XSS = "<script>alert(1)</script>"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """Three logged steps of GRPO on the tiny model, saved at step 3 (no top-level trainer_state),
    with the trainer's own completions.jsonl (log_completions=True)."""
    out = tmp_path_factory.mktemp("run")
    tok = build_tiny_tokenizer()
    args = make_config(
        out, max_steps=3, save_strategy="steps", save_steps=3, logging_steps=1, log_completions=True
    )
    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=length_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train()
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    return out


def _copy_run(src: Path, dst: Path, save_state: bool = True, keep_completions: bool = False) -> Path:
    shutil.copytree(src, dst)
    if not keep_completions:
        (dst / "completions.jsonl").unlink()
    if save_state:  # what trainer.save_state() writes: the state at the end of training
        shutil.copy(dst / "checkpoint-3" / "trainer_state.json", dst / "trainer_state.json")
    return dst


def _write_completions(run: Path, n_steps: int = 3, per_step: int = 4) -> list[dict]:
    """A completions.jsonl in the documented format, both reward layouts, plus extra columns."""
    rows = []
    for step in range(1, n_steps + 1):
        for i in range(per_step):
            row = {
                "step": step,
                "prompt": f"Question {i}: what is {i} plus one?",
                "completion": f"answer {i + 1} at step {step}",
                "advantage": (i - 1.5) / 1.1,
            }
            if i % 2:
                row["rewards/length_reward"] = float(3 + i)
            else:
                row["rewards"] = {"length_reward": float(3 + i)}
            row["process_index"] = 0
            rows.append(row)
    rows[5]["completion"] = f"before {XSS} & after"
    rows[6]["prompt"] = [{"role": "user", "content": "chat <b>prompt</b>"}]
    rows[7]["rewards/length_reward"] = None  # a reward function that returned None
    rows[8]["reward"] = 42.0  # an explicit total wins over the sum
    with (run / "completions.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


# ---- plots ---------------------------------------------------------------------------------------


def test_history_found_in_newest_checkpoint(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path / "run", save_state=False)
    assert not (run / "trainer_state.json").exists()
    checkpoint = run / "checkpoint-3"
    shutil.copytree(checkpoint, run / "checkpoint-2")  # older: must not be chosen
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert plots.find_trainer_state(run) == checkpoint / "trainer_state.json"
    history = plots.load_history(run)
    assert history.last_step == 3
    assert [s for s, _ in history.series["train"]["reward"]] == [1.0, 2.0, 3.0]


def test_write_plots_one_png_per_logged_family(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path / "run")
    logged = plots.load_history(run).metrics()
    paths = write_plots(run)
    names = {p.name for p in paths}
    expected = {
        "rewards.png",
        "reward.png",
        "loss.png",
        "entropy.png",
        "completion_lengths.png",
        "step_time.png",
    }
    if any(m.startswith("clip_ratio/") for m in logged):
        expected.add("clip_ratio.png")
    assert "kl" not in logged  # beta=0: never logged, so no plot
    assert names == expected
    assert all(p.parent == run / "plots" for p in paths)
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC), path
        assert len(data) > 5000, path  # a drawn figure, not an empty canvas


def test_eval_metrics_share_the_axes_of_train_metrics(tmp_path):
    log_history = [
        {"step": 1, "loss": 0.5, "reward": 1.0, "reward_std": 0.2, "kl": 0.01},
        {"step": 2, "loss": 0.4, "reward": 1.5, "reward_std": 0.3, "kl": 0.02},
        {"step": 2, "eval_loss": 0.3, "eval_reward": 1.2, "eval_reward_std": 0.1, "epoch": 0.5},
        {"step": 2, "eval_val_loss": 0.3, "eval_val_kl": 0.03},
        {"step": 2, "train_runtime": 3.0, "train_loss": 0.45},
    ]
    history = plots.parse_log_history(log_history)
    assert history.sources() == ["train", "eval", "eval_val"]
    assert history.series["eval"]["reward"] == [(2.0, 1.2)]
    assert "epoch" not in history.series["eval"]
    assert history.series["eval_val"]["kl"] == [(2.0, 0.03)]
    families = [family.name for family, _ in plots.plan(history)]
    assert families == ["reward", "loss", "kl"]
    paths = plots.write_plots_from_log_history(log_history, tmp_path / "p")
    assert [p.name for p in paths] == ["reward.png", "loss.png", "kl.png"]


def test_plots_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_plots(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        write_plots(tmp_path)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    with pytest.raises(ValueError, match="no log history"):
        write_plots(tmp_path)
    (tmp_path / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        write_plots(tmp_path)


def test_main_plot(trained_run, tmp_path, capsys):
    run = _copy_run(trained_run, tmp_path / "run")
    main_plot([str(run), "--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out.split()
    assert printed and all(Path(p).parent == tmp_path / "figs" and Path(p).is_file() for p in printed)
    with pytest.raises(SystemExit) as exit_info:
        main_plot([str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "posttrain plot:" in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 1.0}]}))
    with pytest.raises(ImportError, match=re.escape("pip install 'posttrain[plot]'")):
        write_plots(tmp_path)


# ---- report --------------------------------------------------------------------------------------


def _table_body(page: str) -> str:
    """The <tbody> of the completions table."""
    return page.split('id="completions"', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]


def _report(trained_run, tmp_path) -> tuple[Path, str, list[dict]]:
    run = _copy_run(trained_run, tmp_path / "run")
    rows = _write_completions(run)
    path = write_report(run)
    assert path == run / "report.html"
    return path, path.read_text(encoding="utf-8"), rows


def test_report_is_self_contained(trained_run, tmp_path):
    _, page, _ = _report(trained_run, tmp_path)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(images) == len(plots.plan(plots.load_history(tmp_path / "run")))
    assert all(src.startswith("data:image/png;base64,") for src in images)
    assert "<style>" in page and "<script>" in page
    assert "<link" not in page


def test_report_table_rows_and_escaping(trained_run, tmp_path):
    _, page, rows = _report(trained_run, tmp_path)
    body = _table_body(page)
    assert body.count("<tr ") == len(rows) == 12
    for step in (1, 2, 3):
        assert body.count(f'<tr data-step="{step}" data-split="train">') == 4
    assert XSS not in page  # the completion never lands as markup
    assert "before &lt;script&gt;alert(1)&lt;/script&gt; &amp; after" in body
    assert "user: chat &lt;b&gt;prompt&lt;/b&gt;" in body
    assert page.count("<script>") == 1  # only the page's own script
    header = page.split('id="completions"', 1)[1].split("</thead>", 1)[0]
    assert ">length_reward<" in header and ">process_index<" in header
    # the total reward: explicit "reward" wins; None rewards are shown as missing
    assert 'data-v="42.0">42<' in body
    assert 'data-v="">–<' in body


def test_report_without_completions_has_curves_and_a_note(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path / "run")
    page = write_report(run, tmp_path / "elsewhere" / "r.html").read_text()
    assert "No completions" in page and "completions.jsonl" in page
    assert 'id="completions"' not in page
    assert page.count("data:image/png;base64,") >= 5


def test_report_with_completions_only_and_bad_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_completions(run, n_steps=3)
    with (run / "completions.jsonl").open("a") as f:
        f.write('{"step": 2, "prompt": "p"}\n{"truncated\n\n')
    with pytest.warns(UserWarning, match="skipped 2 unreadable"):
        page = write_report(run).read_text()
    assert "No curves" in page and "no trainer_state.json" in page
    assert (
        "2 unreadable line(s) skipped" in page
        and "missing key(s) [&#x27;completion&#x27;, &#x27;advantage&#x27;]" in page
    )
    assert _table_body(page).count("<tr ") == 12


def test_report_samples_large_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_completions(run, n_steps=50, per_step=4)
    page = write_report(run, max_rows=30).read_text()
    assert "uniform sample of 30 of the 200" in page
    body = _table_body(page)
    lines = [
        int(n)
        for n in re.findall(r'<tr data-step="\d+" data-split="train"><td class="num" data-v="(\d+)\.0"', body)
    ]
    assert len(lines) == 30 and lines == sorted(lines)


def test_report_reads_the_trainers_completions(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path / "run", keep_completions=True)
    lines = (run / "completions.jsonl").read_text().splitlines()
    assert len(lines) >= 12  # 4 completions per step, 3 steps
    page = write_report(run).read_text()
    body = _table_body(page)
    assert body.count("<tr ") == len(lines)
    assert "unreadable" not in page
    steps = {json.loads(line)["step"] for line in lines}
    assert set(map(int, re.findall(r'<tr data-step="(\d+)"', body))) == steps
    header = page.split('id="completions"', 1)[1].split("</thead>", 1)[0]
    assert ">length_reward<" in header


def test_report_merges_eval_completions(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path / "run")
    _write_completions(run)
    with (run / "eval_completions.jsonl").open("w") as f:
        f.write(
            json.dumps(
                {
                    "step": 3,
                    "prompt": "p",
                    "completion": "eval one",
                    "rewards": {"length_reward": 1.0},
                    "advantage": 0.0,
                }
            )
            + "\n"
        )
    page = write_report(run).read_text()
    body = _table_body(page)
    assert body.count('data-split="train"') == 12 and body.count('data-split="eval"') == 1
    assert 'id="filter-split"' in page and "eval_completions.jsonl: 1 completion(s)." in page


def test_report_bad_input(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        write_report(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main_report([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "posttrain report: no trainer_state.json" in capsys.readouterr().err


def test_report_text_is_printable(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    row = {
        "step": 0,
        "prompt": "p\x00q",
        "completion": "a\x04b\ud800c\td",
        "rewards": {"r": 1},
        "advantage": 0,
    }
    (run / "completions.jsonl").write_text(json.dumps(row) + "\n")
    body = _table_body(write_report(run).read_text(encoding="utf-8"))
    assert "p\u2400q" in body and "a\u2404b\ufffdc\td" in body


def test_parse_row_formats():
    row = report.parse_row(
        {
            "step": 4,
            "prompt": "p",
            "completion": "c",
            "advantage": None,
            "rewards": {"a": 1.0},
            "rewards/b": 2,
        },
        1,
    )
    assert row.rewards == {"a": 1.0, "b": 2.0} and row.reward == 3.0 and row.advantage is None
    with pytest.raises(ValueError, match="'step' must be an integer"):
        report.parse_row({"step": "x", "prompt": "p", "completion": "c", "advantage": 0}, 1)
    with pytest.raises(ValueError, match="must be a number"):
        report.parse_row({"step": 1, "prompt": "p", "completion": "c", "advantage": 0, "rewards/a": "1"}, 1)


def test_main_report(trained_run, tmp_path, capsys):
    run = _copy_run(trained_run, tmp_path / "run")
    _write_completions(run)
    main_report([str(run), "--out", str(tmp_path / "r.html")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


# ---- in a browser --------------------------------------------------------------------------------


def _chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _chromium_or_skip() -> str:
    found = _chromium()
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", str(REPO / ".ci" / "chromium.sh")], capture_output=True, timeout=900)
        found = _chromium()
    if found is None:
        pytest.skip(
            "headless Chromium is not installed and could not be installed (needs root and apt-get); "
            "run .ci/chromium.sh or `apt-get install -y chromium chromium-driver`"
        )
    return found


def _chromium_args(binary: str, profile: Path) -> list[str]:
    return [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,2000",
        "--virtual-time-budget=5000",
    ]


@pytest.mark.slow
def test_report_renders_in_headless_chromium(trained_run, tmp_path):
    binary = _chromium_or_skip()
    run = _copy_run(trained_run, tmp_path / "run")
    _write_completions(run, n_steps=20, per_step=4)  # 80 rows: more than one page of 50
    page = write_report(run)
    n_images = len(plots.plan(plots.load_history(run)))
    url = page.resolve().as_uri()

    shot = tmp_path / "report.png"
    done = subprocess.run(
        [*_chromium_args(binary, tmp_path / "profile-shot"), f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert shot.is_file(), done.stderr[-2000:]
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 20000

    dumped = subprocess.run(
        [*_chromium_args(binary, tmp_path / "profile-dom"), "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=180,
    )
    dom = dumped.stdout
    assert "<body" in dom, dumped.stderr[-2000:]
    body_tag = re.search(r"<body[^>]*>", dom).group(0)
    assert f'data-images-loaded="{n_images}"' in body_tag
    assert f'data-images-total="{n_images}"' in body_tag
    assert 'data-rows="50"' in body_tag  # the first page of the table
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', dom)) == n_images
    assert "rows 1–50 of 80" in dom
    assert dom.count("<script") == 1  # the completion was rendered as text, not as a script
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom
    keep = os.environ.get("POSTTRAIN_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


# Drives the page's controls after load and records what the table showed, on <body> data-*.
HARNESS = """
<script>
window.addEventListener("load", function () {
  const b = document.body, tbody = document.getElementById("completions").tBodies[0];
  const text = document.getElementById("filter-text"), step = document.getElementById("filter-step");
  const headers = Array.from(document.getElementById("completions").tHead.rows[0].cells);
  const rewardCol = headers.findIndex(function (h) { return h.textContent === "reward"; });
  function sorted(dir) {  // numbers in order, then the missing values
    const v = Array.from(tbody.rows).map(function (r) { return parseFloat(r.cells[rewardCol].dataset.v); });
    const n = v.filter(function (x) { return !isNaN(x); });
    return v.slice(0, n.length).every(function (x, i) { return i === 0 || (x - n[i - 1]) * dir >= 0; }) &&
      v.slice(n.length).every(isNaN) && n.length >= 2;
  }
  b.dataset.pagerHidden = String(document.getElementById("pager").hidden);
  document.getElementById("page-next").click();
  b.dataset.page2Rows = b.dataset.rows;
  b.dataset.page2First = tbody.rows[0].cells[0].dataset.v;
  text.value = "ALERT(1)"; text.dispatchEvent(new Event("input"));
  b.dataset.textRows = b.dataset.rows;
  text.value = ""; text.dispatchEvent(new Event("input"));
  step.value = "2"; step.dispatchEvent(new Event("change"));
  b.dataset.stepRows = b.dataset.rows;
  b.dataset.stepOk = String(Array.from(tbody.rows).every(function (r) { return r.dataset.step === "2"; }));
  b.dataset.missing = String(Array.from(tbody.rows).filter(function (r) {
    return r.cells[rewardCol].dataset.v === "";
  }).length);
  headers[rewardCol].click();
  b.dataset.sortedDesc = String(sorted(-1));
  headers[rewardCol].click();
  b.dataset.sortedAsc = String(sorted(1));
  b.dataset.harnessDone = "yes";
});
</script>
"""


@pytest.mark.slow
def test_report_controls_in_headless_chromium(trained_run, tmp_path):
    binary = _chromium_or_skip()
    run = _copy_run(trained_run, tmp_path / "run")
    _write_completions(run, n_steps=20, per_step=4)
    page = write_report(run).read_text(encoding="utf-8")
    driven = tmp_path / "driven.html"
    driven.write_text(page.replace("</body>", HARNESS + "</body>"), encoding="utf-8")
    dumped = subprocess.run(
        [*_chromium_args(binary, tmp_path / "profile"), "--dump-dom", driven.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
    )
    match = re.search(r"<body[^>]*>", dumped.stdout)
    assert match, dumped.stderr[-2000:]
    attrs = dict(re.findall(r'data-([a-z0-9-]+)="([^"]*)"', match.group(0)))
    assert attrs.get("harness-done") == "yes", attrs
    assert attrs["pager-hidden"] == "false"
    assert attrs["page2-rows"] == "30" and attrs["page2-first"] == "51.0"  # rows 51-80 of 80
    assert attrs["text-rows"] == "1"  # the case-insensitive text filter finds the one script text
    assert attrs["step-rows"] == "4" and attrs["step-ok"] == "true"
    assert attrs["missing"] == "1"  # the row whose reward function returned None
    assert attrs["sorted-desc"] == "true" and attrs["sorted-asc"] == "true"


def test_training_writes_plots_at_the_end(tmp_path):
    """The trainer draws the run's curves into output_dir/plots when training ends."""
    from conftest import build_tiny_model, build_tiny_tokenizer
    from helpers import length_reward, make_config, standard_dataset

    from posttrain import GRPOTrainer

    tok = build_tiny_tokenizer()
    GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=2),
        train_dataset=standard_dataset(),
        processing_class=tok,
    ).train()
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert {"reward.png", "entropy.png", "completion_lengths.png"} <= set(names)


def test_report_to_tensorboard_writes_the_grpo_metrics(tmp_path):
    """report_to="tensorboard" goes through transformers' integration, offline, with our metrics."""
    pytest.importorskip("tensorboard")
    from conftest import build_tiny_model, build_tiny_tokenizer
    from helpers import length_reward, make_config, standard_dataset
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain import GRPOTrainer

    tok = build_tiny_tokenizer()
    logs = tmp_path
    GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=2, report_to="tensorboard"),
        train_dataset=standard_dataset(),
        processing_class=tok,
    ).train()
    runs = [p.parent for p in logs.rglob("events.out.tfevents.*")]
    assert runs
    tags = set()
    for run in runs:
        acc = EventAccumulator(str(run))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for metric in ("train/reward", "train/rewards/length_reward/mean", "train/entropy", "train/num_tokens"):
        assert metric in tags, (metric, sorted(tags))
