"""Model families by Hugging Face `model_type` (each implements `rose.models.base.Family`)."""

from rose.models.base import Family
from rose.models.bert import BertModel
from rose.models.gemma3 import Gemma3TextModel
from rose.models.llama import LlamaModel
from rose.models.mistral import MistralModel
from rose.models.qwen2 import Qwen2Model
from rose.models.qwen3 import Qwen3Model
from rose.models.xlm_roberta import XLMRobertaModel

MODELS: dict[str, type[Family]] = {"bert": BertModel, "xlm-roberta": XLMRobertaModel, "qwen3": Qwen3Model}
MODELS.update({"llama": LlamaModel, "mistral": MistralModel, "qwen2": Qwen2Model, "gemma3_text": Gemma3TextModel})


def model_class(model_type: str) -> type[Family]:
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {sorted(MODELS)})") from None
