"""OpenRLHF ``--reward.remote_url`` reward function for the end-to-end test: stablerl.tools.demo's "copy the
digit" task (prompt ``copy 7 :``, label ``7``): the fraction of generated words equal to the label
(EOS / padding not counted; 0 for an empty response). A random policy scores about 1/15."""

SPECIAL = {"<eos>", "<pad>", "<unk>"}


def reward_func(queries, prompts, labels, **kwargs):
    # OpenRLHF's SingleTurnAgentExecutor calls this with one query (prompt + response, decoded) at a time
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        words = [w for w in query.split()[len(prompt.split()):] if w not in SPECIAL]
        rewards.append(sum(w == label for w in words) / len(words) if words else 0.0)
    mean = sum(rewards) / len(rewards)
    return {"rewards": mean, "scores": mean, "extra_logs": {}}
