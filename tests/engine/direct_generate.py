"""vLLM's own API on a checkpoint, with nothing of the project in the path: the reference the rollout
dump is checked against. Prints JSON: per sample, the sampled tokens and every log-prob as float.hex.

    python tests/engine/direct_generate.py CKPT PROMPTS.json MAX_TOKENS SEED THREADS [defaults SAMPLES TEMPERATURE
                                           [MAX_MODEL_LEN KV_CACHE_GIB]]

eager (the default): LLM(..., enforce_eager=True, enable_prefix_caching=False), prompt and sampled log-probs.
defaults: as users launch it, LLM(model, dtype="bfloat16", seed=S) and SamplingParams(n=G, temperature=T,
max_tokens=L, logprobs=0): sampled log-probs only. MAX_MODEL_LEN and KV_CACHE_GIB: the positions and the KV cache the
engine was started with (the rollout records both; a config's full context does not fit 24 GiB), 2,048 and 1 by default.
"""

import json
import os
import sys

checkpoint, prompts_file, max_tokens, seed, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
defaults = len(sys.argv) > 6 and sys.argv[6] == "defaults"
samples, temperature = (int(sys.argv[7]), float(sys.argv[8])) if defaults else (1, 1.0)
max_model_len, kv_cache_gib = (int(sys.argv[9]), sys.argv[10]) if len(sys.argv) > 10 else (2048, "1")
os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=kv_cache_gib, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=threads
)
import torch  # noqa: E402

torch.set_num_threads(int(threads))
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

prompts = json.load(open(prompts_file))
eager = {} if defaults else {"enforce_eager": True, "enable_prefix_caching": False}
llm = LLM(model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_model_len, seed=seed, **eager)
params = SamplingParams(n=samples, max_tokens=max_tokens, prompt_logprobs=None if defaults else 0, logprobs=0, temperature=temperature,
                        detokenize=False)  # fmt: skip
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
result = []
for prompt, out in zip(prompts, outputs, strict=True):
    prompt_lp = [] if defaults else [entry[prompt[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i > 0]
    for sample in out.outputs:
        gen_lp = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids, strict=True)]
        result.append({"generated": list(sample.token_ids), "logprobs": [float(x).hex() for x in prompt_lp + gen_lp]})
print("RESULT " + json.dumps(result))
