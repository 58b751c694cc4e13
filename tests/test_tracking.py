"""Each logging backend, offline, writes the scalars and the sample table: read back from
the files it writes, with readers independent of the Tracker (TensorBoard's
EventAccumulator, the .wandb record log parsed here, trackio's SQLite file via sqlite3)."""

import importlib.util
import json
import sqlite3
import struct

import pytest

from stabledrl import __version__
from stabledrl.metrics import read_metrics
from stabledrl.tracking import SAMPLE_COLUMNS, Tracker

SAMPLES = [{"prompt": "3,5,7=22", "completion": "3*5+7", "reward": 1.0, "correct": True},
           {"prompt": "2,4,9=17", "completion": "2|4\n9", "reward": 0.1, "correct": False}]


def _write_run(run_dir, backends, **kw):
    t = Tracker(run_dir, backends, config={"lr": 3e-5, "objective": {"name": "stabledrl"}}, **kw)
    t.log({"step": 0, "eval_accuracy": 0.25, "collapse": False})
    t.log({"step": 1, "reward_mean": 0.5, "grad_norm": float("nan"), "skipped_steps": 1})
    t.log({"step": 2, "reward_mean": 0.75, "grad_norm": 2.0, "skipped_steps": 1})
    t.log_samples(SAMPLES, step=2)
    t.close()


def _needs(name):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None,
                              reason=f"{name} is not installed (pip install 'stabledrl[{name}]'; "
                                     "trackio's versions: docs/logging.md)")


def test_jsonl_files_and_no_backend_on_other_processes(tmp_path):
    _write_run(tmp_path / "run", [])
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["grad_norm"] is None
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, **s} for s in SAMPLES]
    _write_run(tmp_path / "other", ["tensorboard"], enabled=False)
    assert not (tmp_path / "other").exists()


def test_resume_keeps_samples_up_to_the_checkpoint_and_fresh_start_clears_them(tmp_path):
    run = tmp_path / "run"
    _write_run(run, [])
    t = Tracker(run, [], start_step=1)  # resumed from checkpoint 1: step 2's samples come again
    t.close()
    assert (run / "samples.jsonl").read_text() == ""
    _write_run(run, [])
    t = Tracker(run, [], start_step=2)
    t.close()
    assert len((run / "samples.jsonl").read_text().splitlines()) == 2
    Tracker(run, []).close()  # a fresh run
    assert (run / "samples.jsonl").read_text() == ""


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend.*mlflow"):
        Tracker("unused", ["mlflow"])


def test_tensorboard_scalars_samples_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_run(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("grad_norm")] == [(2, 2.0)]  # NaN left out
    assert [e.value for e in acc.Scalars("collapse")] == [0.0]
    [text] = acc.Tensors("eval/samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "| 2 | 3,5,7=22 | 3*5+7 | 1.0 | True |" in table
    assert "2\\|4<br>9" in table  # a pipe and a newline do not break the table
    [config] = acc.Tensors("config/text_summary")
    assert f'"stabledrl_version": "{__version__}"' in config.tensor_proto.string_val[0].decode()


def _wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", 0xBEE1, version), then
    32 KiB blocks of chunks, each chunk a 7-byte header (checksum, length, type: 1 full,
    2 first, 3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if length == 0 and kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


@_needs("wandb")
def test_wandb_offline_scalars_samples_and_config(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "t",
                 "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(k, v)
    _write_run(tmp_path, ["wandb"])
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [log] = run_dir.glob("run-*.wandb")
    history, config = {}, {}
    for rec in _wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            history[items["_step"]] = items
        elif kind in ("run", "config"):  # wandb.init's config comes in the run record
            update = rec.run.config.update if kind == "run" else rec.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    assert history[1]["reward_mean"] == 0.5 and "grad_norm" not in history[1]
    assert history[2]["reward_mean"] == 0.75 and history[2]["grad_norm"] == 2.0
    assert history[2]["eval/samples/_type"] == "table-file" and history[2]["eval/samples/nrows"] == 2
    assert config["lr"] == 3e-5 and config["stabledrl_version"] == __version__
    [table_file] = (run_dir / "files").rglob("*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [[2, *s.values()] for s in SAMPLES]


@_needs("wandb")
def test_wandb_resumed_run_continues_the_same_run(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(k, v)
    _write_run(tmp_path, ["wandb"])
    Tracker(tmp_path, ["wandb"], start_step=2).close()
    ids = lambda: sorted(p.stem[len("run-"):] for p in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert ids() == [(tmp_path / "wandb-run-id").read_text()] * 2
    Tracker(tmp_path, ["wandb"]).close()  # a fresh run in the same directory: a new wandb run
    assert len(set(ids())) == 2


@_needs("trackio")
def test_trackio_local_scalars_samples_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TRACKIO_PROJECT", "t")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_run(tmp_path / "run", ["trackio"])
    import trackio

    db = trackio.SQLiteStorage.get_project_db_path("t")  # trackio reads TRACKIO_DIR once, at import
    with sqlite3.connect(db) as conn:
        rows = [(s, json.loads(m)) for s, m in conn.execute("select step, metrics from metrics where run_name='run'")]
        [config] = [json.loads(c) for (c,) in conn.execute("select config from configs where run_name='run'")]
    scalars = {s: m for s, m in rows if "eval/samples" not in m}
    assert scalars[1] == {"reward_mean": 0.5, "skipped_steps": 1} and scalars[2]["grad_norm"] == 2.0
    [table] = [m["eval/samples"] for s, m in rows if "eval/samples" in m and s == 2]
    assert table["_type"] == "trackio.table"
    assert table["_value"] == [{"step": 2, **s} for s in SAMPLES]
    assert config["lr"] == 3e-5 and config["stabledrl_version"] == __version__
