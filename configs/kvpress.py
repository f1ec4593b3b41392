"""kvpress's presses as kvlab caches: a method with NVIDIA kvpress 0.5.5's defaults.

    python scripts/generate.py --config configs/kvpress.py:expected_attention
    python scripts/generate.py --config configs/kvpress.py:snapkv,small \
        --config.cache.evict.ratio=0.25

The argument is a cache.evict.method ('snapkv', 'chunkkv:knorm', ...), then
optionally the variant after a comma (tiny, small, base; tiny by default), then
optionally 'decoding' after another comma: kvpress's DecodingPress over the
method instead (configs/kvpress.py:knorm,small,decoding: the prompt stored whole,
every 512 decode steps each head back to 2,048 tokens, scored by the queries of
the decode steps since the last compression: SnapKV's window of 64, Expected
Attention's last 256; tiny: 16 and 64). The
prompt is compressed once after its prefill to the share cache.evict.ratio of
it (0.5 here: kvpress's compression_ratio 0.5), as kvpress's pipeline does
(cache.evict.when='after_prefill'); what follows (a question, the answer)
appends into cache.evict.headroom slots. The method's other fields are
kvpress's (kvlab.eval.benchmark.kvpress_evict: no recent window, SnapKV's
window of 64 kept and averaged pooling, TOVA's last token kept, H2O averaged as
ObservedAttentionPress, AdaKV's alpha 0.2); docs/references.md lists what
still differs. Q-Filters read filters calibrated for the model: set
cache.evict.options.filters; DuoAttention its heads' scores,
cache.evict.options.patterns; Fast KVzip its gates, cache.evict.options.gates;
KVzip, which as kvpress ranks all layers' tokens together, the calibration
contexts' scores, cache.evict.options.scores (each from kvlab.eval.calibrate;
options.layerwise=True gives each layer its share instead).
"""

from kvlab.config import base_config
from kvlab.eval.benchmark import kvpress_decoding, kvpress_evict

# DecodingPress's target_size and compression_interval (kvpress's defaults; tiny's
# fit the tiny model's context), and room for any prompt stored whole.
DECODING = {"tiny": (128, 16), "small": (2048, 512), "base": (2048, 512)}
WHOLE_PROMPT = 1 << 20


def get_config(arg: str = "snapkv"):
    method, _, rest = arg.partition(",")
    variant, _, protocol = rest.partition(",")
    variant = variant or "tiny"
    if protocol not in ("", "decoding"):
        raise ValueError(
            f"configs/kvpress.py:{arg} names the protocol {protocol!r}: use "
            f"'{method},{variant}' (compressed after its prefill) or "
            f"'{method},{variant},decoding' (DecodingPress)"
        )
    cfg = base_config(variant)
    if protocol == "decoding":
        cfg.cache.evict.update(kvpress_decoding(method, *DECODING[variant]), headroom=WHOLE_PROMPT)
        return cfg
    cfg.cache.evict.update(method=method, ratio=0.5, budget=0, when="after_prefill")
    # The generated tokens' room (scripts/generate.py's 48 by default); a longer answer
    # evicts within the budget as every step does.
    cfg.cache.evict.headroom = 48 if variant == "tiny" else 512
    cfg.cache.evict.update(kvpress_evict(method))
    return cfg
