"""The oracle's other side (engine/tests/oracle.rs): Hugging Face
transformers' LlamaForCausalLM, the reference implementation of the model
family, run on a model folder the test wrote.

Reads one JSON object from stdin: {"folder": path, "prompts": [[id, ...],
...], "decode": n}. For each prompt it prints the logits after the prompt
and after each of n greedy decode steps over transformers' own KV cache, as
one JSON list (prompts x (1 + n) x vocab) on stdout.
"""

import inspect
import json
import sys

import torch
from transformers import LlamaForCausalLM


def main():
    req = json.load(sys.stdin)
    model = LlamaForCausalLM.from_pretrained(
        req["folder"], dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    # transformers 5.x names the KV cache `cache`; older releases
    # `past_key_values` (still accepted, deprecated, in 5.x).
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    out = []
    with torch.no_grad():
        for prompt in req["prompts"]:
            r = model(input_ids=torch.tensor([prompt]), use_cache=True)
            logits = [r.logits[0, -1]]
            for _ in range(req["decode"]):
                # torch.argmax answers the first of equal maxima, as the
                # engine's Llama::argmax does.
                nxt = int(torch.argmax(logits[-1]))
                r = model(
                    input_ids=torch.tensor([[nxt]]), use_cache=True, **{name: getattr(r, name)}
                )
                logits.append(r.logits[0, -1])
            out.append([step.tolist() for step in logits])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
