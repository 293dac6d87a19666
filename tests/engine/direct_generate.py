"""vLLM's own API on a checkpoint, with nothing of the project in the path: the reference the rollout
dump is checked against. Prints JSON: per prompt, the sampled tokens and every log-prob as float.hex.

    python tests/engine/direct_generate.py CKPT PROMPTS.json MAX_TOKENS SEED THREADS
"""

import json
import os
import sys

checkpoint, prompts_file, max_tokens, seed, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=threads
)
import torch  # noqa: E402

torch.set_num_threads(int(threads))
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

prompts = json.load(open(prompts_file))
llm = LLM(
    model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=2048, seed=seed,
    enable_prefix_caching=False,
)  # fmt: skip
params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=0, logprobs=0, temperature=1.0, detokenize=False)  # LLM(seed=...)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
result = []
for prompt, out in zip(prompts, outputs, strict=True):
    sample = out.outputs[0]
    prompt_lp = [entry[prompt[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i > 0]
    gen_lp = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids, strict=True)]
    result.append({"generated": list(sample.token_ids), "logprobs": [float(x).hex() for x in prompt_lp + gen_lp]})
print("RESULT " + json.dumps(result))
