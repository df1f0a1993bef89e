"""Preference pairs for the DPO tests: sums in words whose chosen answer is right and rejected
answer wrong, in each of TRL's four record forms (conversational or text, explicit or implicit prompt)."""

import json
import random

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def preference_records(count, form="conversational", seed=0):
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randrange(5), rng.randrange(5)
        wrong = (a + b + rng.randrange(1, 5)) % 10
        question, right, bad = f"{WORDS[a]} plus {WORDS[b]}?", f"{WORDS[a + b]}.", f"{WORDS[wrong]}."
        if rng.random() < 0.3:  # some longer answers: rows of different lengths in a batch
            right, bad = f"it is {right}", f"I think {bad}"
        if form == "conversational":
            records.append({"prompt": [{"role": "user", "content": question}],
                            "chosen": [{"role": "assistant", "content": right}],
                            "rejected": [{"role": "assistant", "content": bad}]})
        elif form == "conversational-implicit":
            turns = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": question}]
            records.append({"chosen": turns + [{"role": "assistant", "content": right}],
                            "rejected": turns + [{"role": "assistant", "content": bad}]})
        elif form == "standard":
            records.append({"prompt": question, "chosen": " " + right, "rejected": " " + bad})
        else:  # standard-implicit
            records.append({"chosen": f"{question} {right}", "rejected": f"{question} {bad}"})
    return records


def write_preference_file(path, records):
    if str(path).endswith(".json"):
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
