"""Checkpoints across the languages against upstream Accelerate itself (its release in
tests/python/requirements-upstream.txt, on PyTorch's CPU wheel): upstream's save_state /
load_state (tests/packages/upstream_run.py) and the C++ job of the interop tests
(tests/multiprocess/programs/python_interop.cpp) write and read each other's folders.

  checkpoint_check.py ACCELERATE_CLI MP_PYTHON_INTEROP MODE [STATE_DICT_TYPE]

MODE:
  python_to_cpp TYPE  upstream's FSDP2 at 4 processes saves (SHARDED_STATE_DICT: DCP folders;
                      FULL_STATE_DICT: pytorch_model_fsdp.bin, optimizer.bin), the C++ job's FSDP
                      at 2 processes resumes; both end at the same parameters.
  cpp_to_python TYPE  the other way: C++ at 2 saves in Python's layout, upstream at 4 resumes.
  readers             PyTorch's own DCP reader (dcp_to_torch_save) reads the C++ job's folders;
                      `accelerate merge-weights` of upstream's DCP folder (safetensors and
                      pytorch_model.bin) equals upstream's full state dict.
  ddp                 upstream's DDP at 2 processes and the C++ job at 2, with transformers'
                      linear warm-up schedule, both ways.
Prints the largest parameter difference of each comparison.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CLI, INTEROP, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
TYPE = sys.argv[4] if len(sys.argv) > 4 else "SHARDED_STATE_DICT"
SWITCH, END = 4, 8
TOLERANCE = 2e-6
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(argv, what):
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    if r.returncode != 0:
        sys.exit("%s failed (exit %d):\n%s\n%s" % (what, r.returncode, r.stdout[-4000:], r.stderr[-8000:]))
    return r


def python(processes, args, what):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            os.path.join(HERE, "upstream_run.py")] + args
    return run(argv, what)


def cpp(processes, args, launch, what):
    argv = [CLI, "launch", "-n", str(processes), "--main_process_port", "0"] + launch + [INTEROP] + args
    return run(argv, what)


def result(path):
    with open(path) as f:
        return json.load(f)


def largest_difference(a, b, what):
    assert sorted(a) == sorted(b), "%s: the runs hold other parameters: %s, %s" % (what, sorted(a), sorted(b))
    worst = 0.0
    for name in a:
        x, y = torch.tensor(a[name], dtype=torch.float64), torch.tensor(b[name], dtype=torch.float64)
        assert x.shape == y.shape, "%s: %s has %s values against %s" % (what, name, x.shape, y.shape)
        worst = max(worst, (x - y).abs().max().item())
    assert worst <= TOLERANCE, "%s: the parameters differ by up to %g (tolerance %g)" % (what, worst, TOLERANCE)
    print("%s: parameters agree within %.3g" % (what, worst))
    return worst


def fsdp_launch(state_dict_type):
    return ["--use_fsdp", "--fsdp_state_dict_type", state_dict_type, "--fsdp_auto_wrap_policy", "NO_WRAP"]


def expect_files(folder, state_dict_type):
    names = set(os.listdir(folder))
    if state_dict_type == "SHARDED_STATE_DICT":
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert sub in names and ".metadata" in os.listdir(os.path.join(folder, sub)), (folder, names)
    else:
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= names, (folder, names)


def python_to_cpp(tmp):
    folder = os.path.join(tmp, "from_python")
    python(4, ["--mode", "fsdp", "--state-dict-type", TYPE, "--steps-to", str(END), "--save-at", str(SWITCH),
               "--save", folder, "--out", os.path.join(tmp, "python.json")], "upstream at 4 processes")
    expect_files(folder, TYPE)
    never_switched = result(os.path.join(tmp, "python.json"))
    assert never_switched["distributed_type"] == "DistributedType.FSDP", never_switched
    cpp(2, ["--steps-from", str(SWITCH), "--steps-to", str(END), "--load", folder, "--scheduler", "none", "--out",
            os.path.join(tmp, "cpp.json")], fsdp_launch(TYPE), "the C++ job at 2 processes")
    resumed = result(os.path.join(tmp, "cpp.json"))
    largest_difference(never_switched["params"], resumed["params"], "%s, upstream at 4 -> C++ at 2" % TYPE)
    assert resumed["step"] == END, "the step of random_states_<p>.pkl was not restored: %s" % resumed["step"]
    # A job without FSDP takes the whole tensors of the same folder.
    cpp(1, ["--steps-from", str(SWITCH), "--steps-to", str(END), "--load", folder, "--scheduler", "none", "--out",
            os.path.join(tmp, "cpp1.json")], [], "the C++ job at 1 process without FSDP")
    largest_difference(never_switched["params"], result(os.path.join(tmp, "cpp1.json"))["params"],
                       "%s, upstream at 4 -> C++ at 1 without FSDP" % TYPE)


def cpp_to_python(tmp):
    folder = os.path.join(tmp, "from_cpp")
    cpp(2, ["--steps-to", str(END), "--save-at", str(SWITCH), "--save", folder, "--scheduler", "none", "--out",
            os.path.join(tmp, "cpp.json")], fsdp_launch(TYPE), "the C++ job at 2 processes")
    expect_files(folder, TYPE)
    never_switched = result(os.path.join(tmp, "cpp.json"))
    python(4, ["--mode", "fsdp", "--state-dict-type", TYPE, "--steps-from", str(SWITCH), "--steps-to", str(END),
               "--load", folder, "--out", os.path.join(tmp, "python.json")], "upstream at 4 processes")
    resumed = result(os.path.join(tmp, "python.json"))
    largest_difference(never_switched["params"], resumed["params"], "%s, C++ at 2 -> upstream at 4" % TYPE)
    assert resumed["step"] == END, "upstream did not restore the step: %s" % resumed["step"]


def readers(tmp):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # PyTorch's own reader of the C++ job's DCP folders.
    cpp_folder = os.path.join(tmp, "from_cpp")
    cpp(2, ["--steps-to", str(SWITCH), "--save-at", str(SWITCH), "--save", cpp_folder, "--scheduler", "none",
            "--out", os.path.join(tmp, "cpp.json")], fsdp_launch("SHARDED_STATE_DICT"), "the C++ job at 2 processes")
    expected = result(os.path.join(tmp, "cpp.json"))["params"]
    dcp_to_torch_save(os.path.join(cpp_folder, "pytorch_model_fsdp_0"), os.path.join(tmp, "model.pt"))
    model = torch.load(os.path.join(tmp, "model.pt"), weights_only=True)["model"]
    largest_difference(expected, {k: v.reshape(-1).tolist() for k, v in model.items()},
                       "dcp_to_torch_save of the C++ job's model folder")
    dcp_to_torch_save(os.path.join(cpp_folder, "optimizer_0"), os.path.join(tmp, "optimizer.pt"))
    optim = torch.load(os.path.join(tmp, "optimizer.pt"), weights_only=True)["optimizer"]
    group = optim["param_groups"][0]
    assert group["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"], group
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999) and group["weight_decay"] == 0.01, group
    for name in group["params"]:
        state = optim["state"][name]
        assert state["step"].item() == SWITCH, (name, state["step"])
        assert state["exp_avg"].shape == model[name].shape and state["exp_avg_sq"].shape == model[name].shape, name
        assert state["exp_avg_sq"].min().item() >= 0 and state["exp_avg"].abs().max().item() > 0, name
    print("dcp_to_torch_save of the C++ job's optimizer folder: 4 parameters, step %d, whole moments" % SWITCH)
    # merge-weights of upstream's own DCP folder, against upstream's full state dict.
    py_folder = os.path.join(tmp, "from_python")
    python(4, ["--mode", "fsdp", "--state-dict-type", "SHARDED_STATE_DICT", "--steps-to", str(SWITCH), "--save-at",
               str(SWITCH), "--save", py_folder, "--out", os.path.join(tmp, "python.json")], "upstream at 4 processes")
    full = result(os.path.join(tmp, "python.json"))["params"]
    run([CLI, "merge-weights", py_folder, os.path.join(tmp, "merged")], "merge-weights")
    merged = load_file(os.path.join(tmp, "merged", "model.safetensors"))
    assert merged["2.weight"].shape == (3, 8), merged["2.weight"].shape
    largest_difference(full, {k: v.reshape(-1).tolist() for k, v in merged.items()},
                       "merge-weights (model.safetensors) of upstream's DCP folder")
    run([CLI, "merge-weights", os.path.join(py_folder, "pytorch_model_fsdp_0"), os.path.join(tmp, "merged_bin"),
         "--unsafe_serialization"], "merge-weights --unsafe_serialization")
    pickled = torch.load(os.path.join(tmp, "merged_bin", "pytorch_model.bin"), weights_only=True)
    largest_difference(full, {k: v.reshape(-1).tolist() for k, v in pickled.items()},
                       "merge-weights (pytorch_model.bin) of upstream's DCP folder")


def ddp(tmp):
    from_python, from_cpp = os.path.join(tmp, "from_python"), os.path.join(tmp, "from_cpp")
    common = ["--scheduler", "linear", "--steps-to", str(END)]
    python(2, ["--mode", "ddp"] + common + ["--save-at", str(SWITCH), "--save", from_python, "--out",
                                            os.path.join(tmp, "python.json")], "upstream's DDP at 2 processes")
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_1.pkl"} <= set(os.listdir(from_python))
    never_switched = result(os.path.join(tmp, "python.json"))
    assert never_switched["distributed_type"] == "DistributedType.MULTI_CPU", never_switched
    cpp(2, ["--steps-from", str(SWITCH), "--steps-to", str(END), "--load", from_python, "--scheduler", "linear",
            "--out", os.path.join(tmp, "cpp.json")], [], "the C++ job at 2 processes")
    resumed = result(os.path.join(tmp, "cpp.json"))
    largest_difference(never_switched["params"], resumed["params"], "DDP, upstream at 2 -> C++ at 2")
    assert abs(resumed["lr"] - never_switched["lr"]) < 1e-12, (resumed["lr"], never_switched["lr"])
    cpp(2, ["--steps-to", str(END), "--save-at", str(SWITCH), "--save", from_cpp, "--scheduler", "linear", "--out",
            os.path.join(tmp, "cpp2.json")], [], "the C++ job at 2 processes")
    never_switched = result(os.path.join(tmp, "cpp2.json"))
    python(2, ["--mode", "ddp"] + common + ["--steps-from", str(SWITCH), "--load", from_cpp, "--out",
                                            os.path.join(tmp, "python2.json")], "upstream's DDP at 2 processes")
    resumed = result(os.path.join(tmp, "python2.json"))
    largest_difference(never_switched["params"], resumed["params"], "DDP, C++ at 2 -> upstream at 2")
    assert abs(resumed["lr"] - never_switched["lr"]) < 1e-12, (resumed["lr"], never_switched["lr"])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        {"python_to_cpp": python_to_cpp, "cpp_to_python": cpp_to_python, "readers": readers, "ddp": ddp}[MODE](tmp)


if __name__ == "__main__":
    main()
