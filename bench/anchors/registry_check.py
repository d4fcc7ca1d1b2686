"""The registry against the reference classes: each model's class built on the
meta device from the config the registry names, every parameter's name and shape
compared. Writes one JSON with, per model, the counts and every difference.

python3 registry_check.py REGISTRY.json OUT.json [WHERE]   (REGISTRY.json from `zoo registry --json`;
WHERE says where it ran, default "GPU runner")
Exits 1 when any name or shape differs.
"""
import importlib
import json
import sys

import torch


def main():
    registry, out = json.load(open(sys.argv[1])), sys.argv[2]
    where = sys.argv[3] if len(sys.argv) > 3 else "GPU runner"
    report, ok = [], True
    for m in registry:
        if m.get("storage", "bf16") != "bf16":
            continue  # a quantized model: its bf16 model's names and shapes, checked there
        ref = m["reference"]
        mod = importlib.import_module(ref["module"])
        cls = getattr(mod, ref["class"])
        with torch.device("meta"):
            if "config_class" in ref:
                model = cls(getattr(mod, ref["config_class"])(**ref["config"]))
            else:
                model = cls(**ref["config"])
        # A component of a larger class (a VAE's decoder): its parameters only.
        prefix = ref.get("prefix", "")
        theirs = {n: list(p.shape) for n, p in model.named_parameters() if n.startswith(prefix)}
        ours = m["params"]
        missing = sorted(set(theirs) - set(ours))
        extra = sorted(set(ours) - set(theirs))
        shapes = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
        equal = not (missing or extra or shapes)
        ok &= equal
        report.append(dict(
            model=m["name"], where=where, reference=f'{ref["module"]}.{ref["class"]}' + (f' ({prefix}*)' if prefix else ''), version=getattr(mod, "__version__", None), torch=torch.__version__,
            reference_params=len(theirs), registry_params=len(ours),
            reference_elements=sum(int(torch.Size(s).numel()) for s in theirs.values()),
            registry_elements=sum(int(torch.Size(s).numel()) for s in ours.values()),
            missing_from_registry=missing, not_in_reference=extra,
            shape_differs=[dict(name=n, registry=ours[n], reference=theirs[n]) for n in shapes], equal=equal))
        print(f'{m["name"]}: {len(ours)} registry parameters vs {len(theirs)} in {ref["class"]}: '
              f'{"names and shapes equal" if equal else f"{len(missing)} missing, {len(extra)} extra, {len(shapes)} shapes differ"}', flush=True)
    json.dump(report, open(out, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
