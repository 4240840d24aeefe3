"""Model families by Hugging Face `model_type` (each implements `rose.models.base.Family`)."""

from rose.models.base import Family
from rose.models.bert import BertModel
from rose.models.pplx_qwen3 import PPLXQwen3Model
from rose.models.qwen3 import Qwen3Model
from rose.models.xlm_roberta import XLMRobertaModel

MODELS: dict[str, type[Family]] = {"bert": BertModel, "xlm-roberta": XLMRobertaModel, "qwen3": Qwen3Model,
                                   "bidirectional_pplx_qwen3": PPLXQwen3Model}


def model_class(model_type: str) -> type[Family]:
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {sorted(MODELS)})") from None
