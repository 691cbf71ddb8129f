"""GPT-2 in Flax NNX with logical-axis sharding.

    from gpt2 import GPT2, GPT2Config, create_sharded_model, from_hf, to_hf
"""

from gpt2.config import ConfigError, GPT2Config
from gpt2.hf import from_hf, to_hf
from gpt2.model import GPT2
from gpt2.sharded_init import create_sharded_model, param_report
from gpt2.sharding import ShardingRules

__all__ = [
    "ConfigError", "GPT2", "GPT2Config", "ShardingRules", "create_sharded_model", "from_hf",
    "param_report", "to_hf",
]
