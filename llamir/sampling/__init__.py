"""llama.cpp's sampler chain (llama-sampler.cpp), token for token.

    from llamir.sampling import Chain, TopK, TopP, MinP, Temp, Dist
    chain = Chain([TopK(40), TopP(0.95, 1), MinP(0.05, 1), Temp(0.8), Dist(1234)])
    token = chain.sample_logits(row)   # one row of logits: apply the chain, accept the pick
    token = chain.sample(ctx, -1)      # the same from a context's output row

Each sampler is named after llama_sampler_init_* and takes its parameters in that order. Given the
same logits and seed, every sampler leaves the candidates (ids, logits, p, selected, sorted) that
llama.cpp's leaves, and dist/mirostat/xtc draw what std::mt19937 and libstdc++ draw.
`Grammar` (GBNF-constrained sampling) lives in llamir.sampling.grammar, imported on first use.
"""

from llamir.sampling.basic import Dist, Greedy, LogitBias, Temp, TempExt
from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.chain import Chain, PerfSamplerData
from llamir.sampling.infill import Infill
from llamir.sampling.mirostat import Mirostat, MirostatV2
from llamir.sampling.penalties import Dry, Penalties
from llamir.sampling.rng import LLAMA_DEFAULT_SEED
from llamir.sampling.sampler import Sampler
from llamir.sampling.truncation import XTC, MinP, TopK, TopNSigma, TopP, Typical

__all__ = ["Chain", "TokenDataArray", "Greedy", "Dist", "TopK", "TopP", "MinP", "Typical", "Temp", "TempExt", "XTC",
           "TopNSigma", "Mirostat", "MirostatV2", "Penalties", "Dry", "LogitBias", "Infill", "Sampler",
           "PerfSamplerData", "LLAMA_DEFAULT_SEED"]


def __getattr__(name: str):
    if name == "Grammar":
        from llamir.sampling.grammar import Grammar

        return Grammar
    raise AttributeError(f"module 'llamir.sampling' has no attribute {name!r}")
