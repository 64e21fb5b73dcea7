"""report_to: each tracker holds metrics.jsonl's values at the same steps (read back from the tracker's own
store), eval lines and completion tables included; a resumed run continues it with each step once; nothing
leaves the machine (W&B offline, Trackio local). Each test skips when its tracker is not installed."""
import json
import os
import struct
import tempfile
import time

import pytest
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.settings.cli import apply_overrides
from grpo.run import trackers

# Trackio reads TRACKIO_DIR once, when imported: point it at a scratch store before any test imports it.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="grpo-test-trackio-")


class Crash(BaseException):
    """Stands in for the process dying: not an Exception, so nothing catches it or saves."""


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No login anywhere: W&B must choose offline mode by itself; its config and cache stay in tmp_path."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def make_trainer(out, tokenizer, **settings) -> Trainer:
    """3 steps of 2 prompts x 4 completions; evaluation at steps 2 and 3, so eval lines share train steps."""
    config = Config(output_dir=str(out), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                    max_prompt_length=16, max_completion_length=6, learning_rate=1e-2, optim="adamw", seed=0,
                    eval_strategy="steps", eval_steps=2, eval_limit=2, eval_accuracy_func="digit_share",
                    eval_format_func=None, eval_free_accuracy_func=None, log_completions=True,
                    num_completions_to_print=3,
                    **settings)
    return Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                   train_dataset=digit_prompts(), eval_dataset=digit_prompts(4))


def jsonl_points(out) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as {key: [(step, value), ...]}, in file order."""
    points: dict[str, list] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        line = json.loads(line)
        for key, value in line.items():
            if key != "step":
                points.setdefault(key, []).append((line["step"], value))
    return points


def assert_same_points(found: dict, expected: dict) -> None:
    assert sorted(found) == sorted(expected)
    for key, points in expected.items():
        assert [s for s, _ in found[key]] == [s for s, _ in points], key
        # trackers may keep float32: one rounding, <= 2**-24 = 6e-8 relative (1e-7 absolute near 0)
        assert [v for _, v in found[key]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-7), key


def tensorboard_points(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return scalars, events


def test_tensorboard_holds_metrics_jsonl(tmp_path, tokenizer, capsys):
    pytest.importorskip("tensorboard", reason="report_to=tensorboard needs the tensorboard extra")
    out = tmp_path / "run"
    make_trainer(out, tokenizer, report_to="tensorboard").train()
    expected = jsonl_points(out)
    assert [s for s, _ in expected["eval/accuracy"]] == [2, 3] and [s for s, _ in expected["loss"]] == [1, 2, 3]
    scalars, events = tensorboard_points(out)
    assert_same_points(scalars, expected)
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("completions/text_summary")}
    assert sorted(texts) == [1, 2, 3] and texts[2].count("\n| 2 | Write ") == 3  # 3 rows of a markdown table
    assert '"max_steps": 3' in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    printed = capsys.readouterr().out
    assert all(f"completions at step {s}" in printed for s in (1, 2, 3))


@pytest.mark.parametrize("tracker", ["tensorboard", "trackio"])
def test_a_resumed_run_continues_the_tracker_run_with_each_step_once(tmp_path, tokenizer, tracker):
    pytest.importorskip(tracker, reason=f"report_to={tracker} needs the {tracker} extra")
    read = {"tensorboard": tensorboard_points, "trackio": trackio_points}[tracker]
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, report_to=tracker, save_steps=2)
    evaluate = first.evaluate
    first.evaluate = lambda: (_ for _ in ()).throw(Crash()) if first.step == 3 else evaluate()
    with pytest.raises(Crash):  # dies after logging step 3, with checkpoint-2 the newest
        first.train()
    assert [s for s, _ in read(out)[0]["loss"]] == [1, 2, 3]
    names = json.loads((out / trackers.TRACKER_RUNS).read_text())
    make_trainer(out, tokenizer, report_to=tracker, save_steps=2, resume_from_checkpoint="latest").train()
    assert json.loads((out / trackers.TRACKER_RUNS).read_text()) == names  # the same tracker run, continued
    points = read(out)[0]
    assert [s for s, _ in points["loss"]] == [1, 2, 3] and [s for s, _ in points["eval/accuracy"]] == [2, 3]
    # TensorBoard holds the resumed run's step 3, Trackio the first run's: timings differ, nothing else.
    volatile = ("perf/", "memory/", "step_time")
    assert_same_points({k: v for k, v in points.items() if not k.startswith(volatile)},
                       {k: v for k, v in jsonl_points(out).items() if not k.startswith(volatile)})


def trackio_points(out):
    from trackio.sqlite_storage import SQLiteStorage
    name = json.loads((out / trackers.TRACKER_RUNS).read_text())["name"]
    logs = SQLiteStorage.get_logs(trackers.PROJECT, name)
    points: dict[str, list] = {}
    for log in logs:
        for key, value in log.items():
            if key not in ("step", "timestamp", "completions"):
                points.setdefault(key, []).append((log["step"], value))
    return points, logs, SQLiteStorage.get_run_config(trackers.PROJECT, name)


def test_trackio_local_store_holds_metrics_jsonl(tmp_path, tokenizer):
    pytest.importorskip("trackio", reason="report_to=trackio needs the trackio extra")
    out = tmp_path / "run"
    make_trainer(out, tokenizer, report_to="trackio").train()
    points, logs, config = trackio_points(out)
    assert_same_points(points, jsonl_points(out))
    tables = {log["step"]: log["completions"] for log in logs if "completions" in log}
    assert sorted(tables) == [1, 2, 3] and config["max_steps"] == 3


def wandb_records(path):
    """The records of a .wandb file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of chunks,
    each with a 7-byte header: checksum, length, type 1 full / 2 first / 3 middle / 4 last)."""
    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


def wandb_history(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The metrics an offline W&B run holds (what `wandb sync` would upload), from its run-ID.wandb file."""
    from wandb.proto import wandb_internal_pb2
    (path,) = run_dir.glob("run-*.wandb")
    # run.finish() can return before W&B's service process has written the last records: wait for its exit record.
    deadline = time.monotonic() + 60
    while True:
        records = []
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    points: dict[str, list] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    points.setdefault(key, []).append((items["_step"], value))
    return points


@pytest.mark.slow  # W&B's service process starts and stops: about 15 s
def test_wandb_offline_run_folder_holds_metrics_jsonl(tmp_path, tokenizer):
    pytest.importorskip("wandb", reason="report_to=wandb needs the wandb extra")
    out = tmp_path / "run"
    make_trainer(out, tokenizer, report_to="wandb").train()  # not logged in: offline by itself
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    assert history.pop("completions/nrows") == [(1, 3), (2, 3), (3, 3)]  # the completions table, 3 rows a step
    expected = jsonl_points(out)
    # The table's own fields share its "completions/" prefix with TRL's completions/* metrics.
    metrics = {k: v for k, v in history.items() if k in expected or not k.startswith("completions/")}
    assert_same_points(metrics, expected)  # a step's train and eval lines share one row
    run_id = json.loads((out / trackers.TRACKER_RUNS).read_text())["wandb_id"]
    assert run_dir.name.endswith(run_id)


def test_report_to_takes_trl_forms_and_names_the_choices():
    assert trackers.tracker_names(Config().report_to) == []  # default "none": nothing leaves the machine
    assert trackers.tracker_names(Config(report_to=["wandb", "tensorboard"]).report_to) == ["wandb", "tensorboard"]
    config = apply_overrides(Config(), ["--report_to=tensorboard, trackio"])
    assert trackers.tracker_names(config.report_to) == ["tensorboard", "trackio"]
    for bad in ("tensorbord", ["wandb", "wandb"], "none,wandb", 3):
        message = 'report_to must be "none" or one or more .* of tensorboard, trackio, wandb'
        with pytest.raises(ConfigError, match=message):
            Config(report_to=bad)


def test_a_missing_tracker_package_is_one_line_before_the_model_loads(monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"^report_to=wandb needs `pip install wandb` \(or grpo\[wandb\]\)$"):
        Trainer(Config(report_to="wandb"), model="not loaded", reward_funcs=[digit_share],
                train_dataset=digit_prompts())


def test_completions_print_as_plain_lines_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "rich.console", None)  # as if rich were not installed
    trackers.print_completions(4, [{"step": 4, "prompt": "Write 2 digits:", "completion": "12", "reward": 1.0,
                                    "advantage": 0.5, "reward/digit_share": None}])
    assert capsys.readouterr().out == ("completions at step 4:\n  prompt=Write 2 digits:  completion=12  reward=1.000"
                                       "  advantage=0.500  reward/digit_share=-\n")
