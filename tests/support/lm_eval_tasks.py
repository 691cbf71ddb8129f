"""Local lm-evaluation-harness tasks (task YAML + jsonl with absolute data paths, so no hub is needed) on the embedded
corpus: multiple choice, loglikelihood_rolling over documents longer than the context, greedy generation."""

import itertools
import json
import lzma

from support.cli import ROOT

with lzma.open(ROOT / "data/assets/shakespeare.jsonl.xz", "rt") as f:
    ASSETS_TEXT = [json.loads(line)["text"] for line in itertools.islice(f, 2)]  # two works of the corpus


MC = [  # a HellaSwag-like multiple choice: the most likely ending
    ("To be, or not to be, that is the", [" question", " answer", " problem", " end"], 0),
    ("Now is the winter of our", [" discontent", " summer", " joy", " house"], 0),
    ("A horse! a horse! my kingdom for a", [" horse", " crown", " sword", " cup"], 0),
    ("Romeo, Romeo! wherefore art thou", [" Romeo", " here", " gone", " there"], 0),
    ("All the world's a", [" stage", " world", " play", " dream"], 0),
    ("The course of true love never did run", [" smooth", " fast", " far", " dry"], 0),
]


GEN = [("KING HENRY:\n", "Once"), ("To be, or not to be", ", that"), ("O", "ROMEO"), ("What", "!")]


def write_tasks(directory):
    """Three local lm-eval tasks (task YAML + jsonl, absolute data paths: no hub): multiple choice,
    loglikelihood_rolling over documents longer than the context, and greedy generation."""
    def task(name, docs, body):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")

    task("tiny_mc", [{"q": q, "choices": c, "label": a} for q, c, a in MC],
         "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
         "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    docs = [ASSETS_TEXT[0][:1500], ASSETS_TEXT[1][:400], "naïve café — “quotes” 日本語 🤖\n\n  spaces   end",
            "short"]
    task("tiny_rolling", [{"text": t} for t in docs],
         "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
         "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    task("tiny_gen", [{"prompt": p, "answer": a} for p, a in GEN],
         "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
         "generation_kwargs:\n  until: [\"\\n\\n\", \"!!!\"]\n  max_gen_toks: 12\n  do_sample: false\n"
         "metric_list:\n  - metric: exact_match\n")
    return directory
