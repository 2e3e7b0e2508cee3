"""A stand-in for deepspec/targets/vllm_feature_worker.py that speaks its protocol with transformers
(run by the test's own python): the hidden states of vLLM's layer ids (id k: the input of decoder
layer k, i.e. the output of layer k - 1), each prompt alone, one safetensors file per prompt. So the
fast tests check DeepSpec's side (the layer-id shift, the final norm, the order, the errors) in
seconds; tests/cache/test_engine_vllm.py runs vLLM.

Faults, from the environment: FAKE_REFUSE=<text> refuses at load the way vLLM's front end does (a
generic line, the reason only in the log); FAKE_DIE_ON=<n> exits without a reply on request n.
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file


def main(job_path: str, reply_fd: str) -> int:
    reply_file = os.fdopen(int(reply_fd), "w", buffering=1)

    def reply(record: dict) -> None:
        reply_file.write(json.dumps(record) + "\n")
        reply_file.flush()

    job = json.load(open(job_path))
    if os.environ.get("FAKE_REFUSE"):
        reason = os.environ["FAKE_REFUSE"]
        print(f"(EngineCore pid=1) ERROR [core.py:1] RuntimeError: {reason}", flush=True)
        reply({"ok": False, "error_type": "RuntimeError",
               "error": "Engine core initialization failed. See root cause above. "
                        "Failed core proc(s): {}"})
        return 3
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["target"], dtype=getattr(torch, job["dtype"]))
    model.eval()
    layers = model.model.layers
    reply({"event": "ready", "ok": True, "vllm_version": "fake", "load_s": 0.0})
    for line in sys.stdin:
        request = json.loads(line)
        if str(request["id"]) == os.environ.get("FAKE_DIE_ON"):
            os._exit(7)
        paths = []
        for n, ids in enumerate(request["prompts"]):
            captured = {}

            def hook(k, seen=captured):
                def record(_module, _inputs, out):
                    seen[k] = out[0] if isinstance(out, tuple) else out
                return record

            handles = [layers[k - 1].register_forward_hook(hook(k)) for k in job["layer_ids"]]
            with torch.no_grad():
                model.model(input_ids=torch.tensor([ids]))
            for handle in handles:
                handle.remove()
            path = os.path.join(job["spool"], f"{request['id']}-{n}.safetensors")
            hidden = torch.stack([captured[k][0] for k in job["layer_ids"]], dim=1)
            save_file({"hidden_states": hidden.contiguous(), "token_ids": torch.tensor(ids)}, path)
            paths.append(path)
        reply({"id": request["id"], "ok": True, "paths": paths})
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
