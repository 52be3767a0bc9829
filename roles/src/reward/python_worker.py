"""yatt's Python reward worker (embedded in yatt-roles, written to a temp file at start).

    python -u python_worker.py FILE.py FUNCTION BATCHED(0|1)

Protocol, one JSON object per line:
  worker -> yatt, once:  {"ready": true, "pid": N}  or  {"error": "<traceback>"}
  yatt -> worker:        {"id": N, "items": [{"data_source", "solution_str",
                                               "ground_truth", "extra_info"}, ...]}
  worker -> yatt:        {"id": N, "results": [{"score": f, "step_scores": [f] | null}
                                               | {"error": "<traceback>"}, ...]}
                     or  {"id": N, "error": "<traceback>"}   (the batched call raised)

The user's prints (and anything C code writes to fd 1) go to stderr: fd 1 is kept for
the protocol alone.
"""

import importlib.util
import json
import math
import os
import sys
import traceback


def load(path, name):
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("yatt_user_reward", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["yatt_user_reward"] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{path} has no function {name!r}; it defines {found}")
    return fn


def to_score(value):
    steps = None
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the reward function returned a dict without 'score' (keys {sorted(value)})")
        steps = value.get("step_scores")
        value = value["score"]
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"the reward function returned {value!r}; expected a number or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned {score}; expected a finite number")
    if steps is not None:
        steps = [float(s) for s in steps]
    return {"score": score, "step_scores": steps}


def user_traceback(e):
    """The traceback without this worker's frame when the error is in the user's code."""
    tb = e.__traceback__
    if tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def one(fn, item):
    try:
        return to_score(fn(data_source=item["data_source"], solution_str=item["solution_str"],
                           ground_truth=item["ground_truth"], extra_info=item["extra_info"]))
    except Exception as e:
        return {"error": user_traceback(e)}


def batch(fn, items):
    out = fn(data_sources=[i["data_source"] for i in items],
             solution_strs=[i["solution_str"] for i in items],
             ground_truths=[i["ground_truth"] for i in items],
             extra_infos=[i["extra_info"] for i in items])
    out = list(out)
    if len(out) != len(items):
        raise ValueError(f"the batched reward function returned {len(out)} scores for {len(items)} samples")
    return [to_score(v) for v in out]


def main():
    path, name, batched = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        fn = load(path, name)
    except BaseException:
        send({"error": traceback.format_exc()})
        return 1
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if batched:
            try:
                send({"id": req["id"], "results": batch(fn, req["items"])})
            except Exception as e:
                send({"id": req["id"], "error": user_traceback(e)})
        else:
            send({"id": req["id"], "results": [one(fn, i) for i in req["items"]]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
