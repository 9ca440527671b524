"""torchvision's ResNets as the oracle for dtrain's (tests/resnet_test.cpp).

  python resnet_oracle.py OUT DEPTH            writes OUT/expected.safetensors (below)
  python resnet_oracle.py --check FILE DEPTH   loads FILE (dtrain's weights under its names,
      "input" and dtrain's evaluation logits "logits") into torchvision's resnetDEPTH, strictly,
      and exits 1 unless torchvision's logits equal dtrain's (1e-5 of their scale)
The first writes OUT/expected.safetensors: torchvision's resnetDEPTH(num_classes=10) state dict (its names;
BatchNorm's running statistics and affine parameters drawn at random so they count), an input
batch [4, 3, 40, 40], and the logits on it in evaluation mode in float32 ("eval32") and float64
("eval64") and in training mode (batch statistics) in float64 ("train64")."""
import sys

import torch
import torchvision
from safetensors.torch import save_file


def check(path, depth):
    from safetensors.torch import load_file
    tensors = load_file(path)
    state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
    model = getattr(torchvision.models, f"resnet{depth}")(num_classes=10)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(tensors["input"])
    scale = tensors["logits"].abs().max().item()
    difference = (logits - tensors["logits"]).abs().max().item()
    print(f"torchvision's logits on dtrain's weights: {difference:.3g} from dtrain's (scale {scale:.3g})")
    return 0 if difference <= 1e-5 * scale else 1


def main():
    if sys.argv[1] == "--check":
        return check(sys.argv[2], int(sys.argv[3]))
    out, depth = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = getattr(torchvision.models, f"resnet{depth}")(num_classes=10)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    x = torch.randn(4, 3, 40, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eval32 = model.eval()(x)
        model = model.double()
        eval64 = model(x.double())
        train64 = model.train()(x.double())
    save_file({**{"state." + k: v for k, v in state.items()}, "input": x, "eval32": eval32,
               "eval64": eval64, "train64": train64}, out + "/expected.safetensors")


if __name__ == "__main__":
    sys.exit(main())
