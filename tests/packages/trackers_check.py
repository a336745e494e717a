"""Reads runs of tests/packages/tracker_run back with the real wandb and mlflow packages.

    trackers_check.py <tracker_run> wandb <env of the current wandb>
                                              W&B's own reader on the offline run, `wandb sync --view`,
                                              and the current release's `wandb leet inspect --summary`
    trackers_check.py <tracker_run> mlflow    a real `mlflow server`; its client reads the run
    trackers_check.py <tracker_run> restart   the server killed mid-run and started again: nothing lost
    trackers_check.py <tracker_run> down      no server at all: everything kept in the pending file
    trackers_check.py <tracker_run> example <accelerate> <tracking_services>
                                              the by-feature example on 2 processes, read by both

Runs in the environment scripts/python_env.sh makes; exits 1 naming the first difference.
"""
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

STEPS = 8
PROJECT = "cpp_project"


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def expect_close(got, want, what):
    check(abs(float(got) - want) <= 1e-9 * max(1.0, abs(want)), f"{what}: got {got}, expected {want}")


def run_program(program, args, cwd, env, background=False):
    command = [program] + [str(a) for a in args]
    if background:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    check(result.returncode == 0, f"{command} exited with {result.returncode}: {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def expected_loss(step):
    return 1.0 / (step + 1)


# ---- W&B ---------------------------------------------------------------------------------------

def check_wandb(program, work, current_env):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=work)
    out, _ = run_program(program, ["wandb", PROJECT, STEPS], work, env)
    run_dir = os.path.join(work, out["wandb_run_dir"]) if not os.path.isabs(out["wandb_run_dir"]) else out["wandb_run_dir"]
    run_id = run_dir.rsplit("-", 1)[1]
    path = os.path.join(run_dir, f"run-{run_id}.wandb")
    check(os.path.isfile(path), f"no run file {path}")
    check(os.path.realpath(os.path.join(work, "wandb", "latest-run")) == os.path.realpath(run_dir),
          "wandb/latest-run does not point at the run")

    records = read_wandb_file(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    print("wandb: records", kinds)
    check([r.num for r in records] == list(range(1, len(records) + 1)), "record numbers are not 1, 2, ...")
    check(kinds[0] == "header" and kinds[1] == "run" and kinds[-1] == "exit", f"record order {kinds}")

    run = records[1].run
    check(run.run_id == run_id and run.project == PROJECT, f"run id/project {run.run_id}/{run.project}")
    check(run.display_name == "cpp-run" and list(run.tags) == ["cpp", "test"] and run.notes == "from accelerate-cpp",
          f"name/tags/notes {run.display_name} {list(run.tags)} {run.notes}")
    check(run.host != "" and abs(run.start_time.seconds - time.time()) < 600, "host or start time")

    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            for item in r.config.update:
                config[item.key] = json.loads(item.value_json)
    check(config.get("learning_rate") == 0.001 and config.get("batch_size") == 32 and config.get("model") == "gpt"
          and config.get("use_amp") is True and "dropout" in config and config["dropout"] is None,
          f"config {dict((k, v) for k, v in config.items() if k != 'long_text')}")
    check(config.get("long_text") == "x" * 70000, "the 70 000-character config value (split across blocks) differs")

    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {}
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            check(row["_step"] == r.history.step.num, f"_step {row['_step']} vs step {r.history.step.num}")
            rows.append(row)
    check([row["_step"] for row in rows] == list(range(STEPS + 1)), f"history steps {[row['_step'] for row in rows]}")
    check(not any("late" in row for row in rows), "a log at an earlier step was kept")
    check(rows[STEPS - 1].get("auto") == 1 and rows[STEPS].get("auto") == 2 and list(rows[STEPS]) ==
          ["auto", "_step", "_runtime", "_timestamp"], f"logs without a step: {rows[STEPS - 1]}, {rows[STEPS]}")
    rows = rows[:STEPS]
    for row in rows:
        s = row["_step"]
        expect_close(row["loss"], expected_loss(s), f"history loss at {s}")
        expect_close(row["accuracy"], s * 0.01, f"history accuracy at {s}")
        expect_close(row["grad_norm"], math.sqrt(s + 1), f"history grad_norm at {s}")
        check(row["_timestamp"] > 1e9 and row["_runtime"] >= 0, f"_timestamp/_runtime at {s}")
    row = rows[1]
    check(row.get("note") == "halfway", f"text value {row.get('note')}")
    check(row.get("lr/group0") == 0.5 and row.get("lr/group1") == 0.25, "nested lr values")
    check(row.get("samples/_type") == "images/separated" and row.get("samples/count") == 2
          and row.get("samples/width") == 5 and row.get("samples/height") == 4, f"images {row}")
    media = [r.files for r in records if r.WhichOneof("record_type") == "files"]
    listed = [f.path for files in media for f in files.files]
    check(listed == row["samples/filenames"], f"files record {listed} vs {row['samples/filenames']}")
    from PIL import Image
    for name in listed:
        with Image.open(os.path.join(run_dir, "files", name)) as image:
            check(image.size == (5, 4) and image.mode == "RGB", f"{name}: {image.size} {image.mode}")

    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    expect_close(summary["loss"], expected_loss(STEPS - 1), "summary loss")
    check(summary["_step"] == STEPS and summary["auto"] == 2, f"summary _step {summary['_step']}")
    check(records[-1].exit.exit_code == 0, "exit code")

    # The command users run before uploading: it reads the file with the same reader and prints it.
    cli_env = dict(os.environ, WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_DIR=work)
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    view = subprocess.run([wandb_cli, "sync", "--legacy", "--view", "--verbose", path], cwd=work, env=cli_env,
                          capture_output=True, text=True, timeout=120)
    check(view.returncode == 0, f"wandb sync --view exited with {view.returncode}: {view.stderr[-2000:]}")
    check(view.stdout.count("Record:") == len(records),
          f"wandb sync --view printed {view.stdout.count('Record:')} records, the reader read {len(records)}")
    check('display_name: "cpp-run"' in view.stdout, "wandb sync --view does not show the run's name")
    # The current release reads run files with its compiled service (wandb-core), which `wandb sync`
    # uploads through; `wandb leet inspect --summary --json` prints what it read.
    current = os.path.join(current_env, "bin", "wandb")
    check(os.path.isfile(os.path.join(current_env, ".complete")),
          f"the environment {current_env} is missing: run scripts/python_env.sh tests/python/requirements-wandb.txt")
    inspect = subprocess.run([current, "leet", "inspect", "--summary", "--json", path], cwd=work, env=cli_env,
                             capture_output=True, text=True, timeout=120)
    check(inspect.returncode == 0, f"wandb leet inspect exited with {inspect.returncode}: {inspect.stderr[-2000:]}")
    state = json.loads(inspect.stdout)
    check(state["state"] == "finished" and state["exit_code"] == 0 and state["run_id"] == run_id
          and state["project"] == PROJECT and state["step"] == STEPS, f"wandb-core read {state}")
    expect_close(state["summary"]["loss"], expected_loss(STEPS - 1), "wandb-core's summary loss")
    check(state["config"]["batch_size"] == 32 and state["config"]["long_text"] == "x" * 70000,
          "wandb-core's config")
    print(f"wandb: {len(records)} records, {len(rows)} history rows, {len(config)} config keys, "
          f"{len(listed)} images; `wandb sync --view` printed {view.stdout.count('Record:')} records; "
          f"the current release ({current_env}) read state {state['state']}, step {state['step']}")


# ---- MLflow ------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, work, port):
        self.work, self.port, self.process = work, port, None
        self.uri = f"http://127.0.0.1:{port}"

    def start(self):
        mlflow_cli = os.path.join(os.path.dirname(sys.executable), "mlflow")
        log = open(os.path.join(self.work, "server.log"), "a")
        self.process = subprocess.Popen(
            [mlflow_cli, "server", "--backend-store-uri", f"sqlite:///{self.work}/mlflow.db",
             "--default-artifact-root", f"{self.work}/artifacts", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"],
            cwd=self.work, stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            check(self.process.poll() is None, "mlflow server exited: " + open(os.path.join(self.work, "server.log")).read()[-3000:])
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        fail("mlflow server did not answer within 120 s")

    def kill(self):
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def read_mlflow_run(uri, run_id):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(PROJECT)
    check(experiment is not None, f"no experiment {PROJECT}")
    run = client.get_run(run_id)
    check(run.info.experiment_id == experiment.experiment_id, "the run is in another experiment")
    metrics = {key: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))
               for key in ("loss", "accuracy", "grad_norm", "note", "lr", "lr/group0")}
    return run, metrics


def check_mlflow_run(run, metrics):
    check(run.info.status == "FINISHED" and run.info.end_time is not None, f"status {run.info.status}")
    check(run.info.run_name == "cpp-run", f"run name {run.info.run_name}")
    params = run.data.params
    check(params == {"learning_rate": "0.001", "batch_size": "32", "model": "gpt", "use_amp": "True",
                     "dropout": "None"}, f"params {params}")
    tags = run.data.tags
    check(tags.get("team") == "cpp" and tags.get("mlflow.note.content") == "from accelerate-cpp"
          and tags.get("mlflow.runName") == "cpp-run" and tags.get("mlflow.source.type") == "LOCAL",
          f"tags {tags}")
    for key, want in (("loss", expected_loss), ("accuracy", lambda s: s * 0.01), ("grad_norm", lambda s: math.sqrt(s + 1))):
        got = metrics[key]
        check([step for step, _, _ in got] == list(range(STEPS)), f"{key} steps {[s for s, _, _ in got]}")
        for step, value, stamp in got:
            expect_close(value, want(step), f"{key} at step {step}")
            check(abs(stamp / 1000 - time.time()) < 600, f"{key} timestamp {stamp}")
    for dropped in ("note", "lr", "lr/group0"):
        check(metrics[dropped] == [], f"{dropped} should not be a metric: {metrics[dropped]}")


def check_mlflow(program, work, mode):
    server = Server(work, free_port())
    env = dict(os.environ, MLFLOW_TRACKING_URI=server.uri, MLFLOW_HTTP_REQUEST_TIMEOUT="10")
    if mode == "mlflow":
        server.start()
        try:
            out, _ = run_program(program, ["mlflow", PROJECT, STEPS], work, env)
            run, metrics = read_mlflow_run(server.uri, out["mlflow_run_id"])
            check_mlflow_run(run, metrics)
            print(f"mlflow: run {out['mlflow_run_id']}: {run.info.status}, params {run.data.params}, "
                  f"{sum(len(v) for v in metrics.values())} metric values")
        finally:
            server.kill()
        return
    if mode == "restart":
        server.start()
        control = os.path.join(work, "control")
        os.makedirs(control)
        proc = run_program(program, ["mlflow", PROJECT, STEPS, 2, control], work, env, background=True)
        try:
            wait_file(os.path.join(control, "paused"), proc)
            # The server has the run and its first two steps before it dies: killed mid-run.
            from mlflow.tracking import MlflowClient
            client = MlflowClient(tracking_uri=server.uri)
            deadline = time.time() + 60
            while True:
                experiment = client.get_experiment_by_name(PROJECT)
                runs = client.search_runs([experiment.experiment_id]) if experiment else []
                if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) == 2:
                    break
                check(time.time() < deadline, "the server did not get steps 0 and 1 within 60 s")
                time.sleep(0.2)
            server.kill()
            print("mlflow: server killed (SIGKILL) after it had steps 0-1")
            open(os.path.join(control, "resume"), "w").close()
            wait_file(os.path.join(control, "logged_while_down"), proc)
            # The tracker meets the dead server and keeps what it cannot send in its pending file.
            deadline = time.time() + 30
            while True:
                kept = []
                for path in glob.glob(os.path.join(work, "project", "mlflow-pending-*.jsonl")):
                    for line in open(path):
                        kept += [m["step"] for m in json.loads(line).get("body", {}).get("metrics", [])
                                 if m["key"] == "loss"]
                if sorted(kept) == [2, 3, 4]:
                    break
                check(time.time() < deadline, f"the pending file holds loss steps {sorted(kept)}, not 2-4")
                time.sleep(0.2)
            print("mlflow: while the server was down, steps 2-4 were kept in the pending file")
            server.start()
            print("mlflow: server started again after steps 2-4 were logged")
            open(os.path.join(control, "finish"), "w").close()
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        check(proc.returncode == 0, f"tracker_run exited with {proc.returncode}: {stderr[-3000:]}")
        out = json.loads(stdout.strip().splitlines()[-1])
        check(stderr.count("cannot reach the tracking server") == 1, "expected one warning that the server is "
              "unreachable, got:\n" + stderr[-3000:])
        check("reachable again" in stderr, "no word that the server was reached again:\n" + stderr[-3000:])
        check(out["mlflow_pending"] == 0 and not os.path.exists(os.path.join(work, out["mlflow_pending_file"])),
              f"requests left: {out['mlflow_pending']} in {out['mlflow_pending_file']}")
        try:
            run, metrics = read_mlflow_run(server.uri, out["mlflow_run_id"])
            check_mlflow_run(run, metrics)
        finally:
            server.kill()
        print(f"mlflow: after the restart the server holds all {STEPS} steps of each metric; stderr said:")
        print("\n".join(line for line in stderr.splitlines() if "MLflowTracker" in line))
        return
    # down: nothing listens on the port.
    env["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"
    env["TRACKER_RUN_FLUSH_TIMEOUT"] = "3"
    proc = subprocess.run([program, "mlflow", PROJECT, str(STEPS)], cwd=work, env=dict(env), capture_output=True,
                          text=True, timeout=600)
    check(proc.returncode == 0, f"tracker_run exited with {proc.returncode}: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pending_file = os.path.join(work, out["mlflow_pending_file"])
    check(out["mlflow_pending"] > 0 and os.path.isfile(pending_file), f"nothing kept: {out}")
    lines = [json.loads(line) for line in open(pending_file)]
    check(lines[0]["request"] == "start" and lines[0]["run"]["experiment_name"] == PROJECT, f"first line {lines[0]}")
    kept = [m for line in lines[1:] for m in line.get("body", {}).get("metrics", [])]
    check(sorted(m["step"] for m in kept if m["key"] == "loss") == list(range(STEPS)), "kept loss steps")
    check(lines[-1]["request"].endswith("runs/update") and lines[-1]["body"]["status"] == "FINISHED", "kept run end")
    check("did not reach" in proc.stderr and out["mlflow_pending_file"] in proc.stderr,
          "finish does not name what is left and where:\n" + proc.stderr[-3000:])
    print(f"mlflow: with no server, {len(lines)} requests ({len(kept)} metric values) kept in the pending file")


def read_wandb_file(path):
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore
    store = datastore.DataStore()
    store.open_for_scan(path)
    records = []
    while True:
        data = store.scan_data()
        if data is None:
            return records
        record = pb.Record()
        record.ParseFromString(data)
        records.append(record)


def check_example(accelerate, example, work):
    server = Server(work, free_port())
    server.start()
    env = dict(os.environ, MLFLOW_TRACKING_URI=server.uri, WANDB_DIR=work)
    env.pop("WANDB_MODE", None)
    try:
        result = subprocess.run([accelerate, "launch", "--num_processes", "2", "--main_process_port", "0", example,
                                 "--project_dir", os.path.join(work, "project")], cwd=work, env=env,
                                capture_output=True, text=True, timeout=600)
        check(result.returncode == 0, f"the example exited with {result.returncode}: {result.stderr[-3000:]}")
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=server.uri)
        experiment = client.get_experiment_by_name("spirals")
        check(experiment is not None, "no experiment 'spirals'")
        runs = client.search_runs([experiment.experiment_id])
        check(len(runs) == 1, f"{len(runs)} runs: only the main process logs")
        run = runs[0]
        check(run.info.status == "FINISHED" and run.info.run_name == "mlp"
              and run.data.tags.get("example") == "tracking_services", f"run {run.info} {run.data.tags}")
        check(run.data.params == {"learning_rate": "0.01", "num_epochs": "4"}, f"params {run.data.params}")
        accuracy = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
        epochs = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "epoch"))
        check(len(accuracy) == 4 and [v for _, v in epochs] == [0, 1, 2, 3], f"accuracy {accuracy} epochs {epochs}")
    finally:
        server.kill()
    folders = [f for f in os.listdir(os.path.join(work, "wandb")) if f.startswith("offline-run-")]
    check(len(folders) == 1, f"W&B runs {folders}")
    run_id = folders[0].rsplit("-", 1)[1]
    records = read_wandb_file(os.path.join(work, "wandb", folders[0], f"run-{run_id}.wandb"))
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    check([row["epoch"] for row in rows] == [0, 1, 2, 3], f"W&B rows {rows}")
    # Both trackers saw the same values at the same steps.
    check([(row["_step"], row["accuracy"]) for row in rows] == accuracy, f"W&B {rows} vs MLflow {accuracy}")
    print(f"example: MLflow and W&B both hold 4 epochs; accuracy {[round(v, 4) for _, v in accuracy]}")


def wait_file(path, proc):
    deadline = time.time() + 120
    while not os.path.exists(path):
        if proc.poll() is not None:
            fail(f"tracker_run exited with {proc.returncode} before {path}: {proc.stderr.read()[-3000:]}")
        check(time.time() < deadline, f"{path} did not appear")
        time.sleep(0.05)


def main():
    program, mode = os.path.abspath(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as work:
        if mode == "wandb":
            check_wandb(program, work, os.path.abspath(sys.argv[3]))
        elif mode == "example":
            check_example(os.path.abspath(sys.argv[3]), os.path.abspath(sys.argv[4]), work)
        else:
            check_mlflow(program, work, mode)
    print("PASS")


if __name__ == "__main__":
    main()
