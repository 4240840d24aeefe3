"""Model families by Hugging Face `model_type` (each implements `rose.models.base.Family`)."""

from rose.models.base import Family
from rose.models.bert import BertModel
from rose.models.clip import CLIPModel
from rose.models.deberta_v2 import DebertaV2Model
from rose.models.distilbert import DistilBertModel
from rose.models.electra import ElectraModel
from rose.models.gemma3 import Gemma3TextModel
from rose.models.llama import LlamaModel
from rose.models.mistral import MistralModel
from rose.models.modernbert import ModernBertModel
from rose.models.mpnet import MPNetModel
from rose.models.nomic_bert import NomicBertModel
from rose.models.pplx_qwen3 import PPLXQwen3Model
from rose.models.qwen2 import Qwen2Model
from rose.models.qwen3 import Qwen3Model
from rose.models.roberta import CamembertModel, RobertaModel
from rose.models.siglip import SiglipModel
from rose.models.splade import DistilBertSpladeModel, SpladeModel
from rose.models.t5 import T5EncoderModel
from rose.models.xlm_roberta import XLMRobertaModel
from trellis.modeldir import ModelSpec

MODELS: dict[str, type[Family]] = {
    "bert": BertModel, "xlm-roberta": XLMRobertaModel, "roberta": RobertaModel, "camembert": CamembertModel,
    "deberta-v2": DebertaV2Model, "distilbert": DistilBertModel, "electra": ElectraModel, "mpnet": MPNetModel,
    "modernbert": ModernBertModel, "nomic_bert": NomicBertModel, "qwen3": Qwen3Model,
    "bidirectional_pplx_qwen3": PPLXQwen3Model, "llama": LlamaModel, "mistral": MistralModel, "qwen2": Qwen2Model,
    "gemma3_text": Gemma3TextModel, "t5": T5EncoderModel, "clip": CLIPModel, "siglip": SiglipModel}
# Masked-LM checkpoints (architectures *ForMaskedLM) served as SPLADE where the directory has no dense
# Pooling module (none at all, or sentence-transformers' SpladePooling), by model_type.
SPLADE: dict[str, type[Family]] = {"bert": SpladeModel, "distilbert": DistilBertSpladeModel}


def model_class(spec: ModelSpec) -> type[Family]:
    masked_lm = any(a.endswith("ForMaskedLM") for a in spec.config.get("architectures") or ())
    if spec.pooling == "splade" or (masked_lm and not spec.pooling and spec.model_type in SPLADE):
        if not (masked_lm and spec.model_type in SPLADE):
            raise ValueError(f"SPLADE pooling needs a masked-LM checkpoint of {sorted(SPLADE)} "
                             f"(this one: {spec.model_type} {spec.config.get('architectures')})")
        return SPLADE[spec.model_type]
    try:
        return MODELS[spec.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {spec.model_type!r} (supported: {sorted(MODELS)})") from None
