"""A Llama-3-8B-shaped model directory for `vllm --load-format dummy` (random weights): its config
and a BPE tokenizer trained on this repository's text, so a GPU machine without hub access can
serve it. Needs `tokenizers` and `transformers` (there with vLLM; not a dependency of `lb`).

    python -m bench.real_vllm.model /tmp/model   # run from the repository root
"""
import glob
import json
import pathlib
import sys


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(glob.glob("docs/*.md") + glob.glob("lb/**/*.py", recursive=True) + glob.glob("bench/**/*.py", recursive=True))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=16000, special_tokens=["<unk>", "<s>", "</s>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    t.save_pretrained(out)
    vocab = (len(t) + 63) // 64 * 64
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
               "max_position_embeddings": 8192, "rope_theta": 500000.0, "vocab_size": vocab,
               "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16", "dtype": "bfloat16"}, open(out / "config.json", "w"), indent=1)
    print("model dir", out, "vocab", len(t), "->", vocab)


if __name__ == "__main__":
    main()
