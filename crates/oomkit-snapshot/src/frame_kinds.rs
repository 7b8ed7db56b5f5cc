//! What the frames of a stack say its allocation was for: a gradient, a
//! library's workspace, the optimizer, backward, the inputs, the model's
//! own weights, forward work, or nothing at all. Each distinct frame is
//! looked at once; the role decider (`roles.rs`) builds on these kinds.

use crate::stacks::{Frame, FrameId, StackId, Stacks};

/// What the frames of a stack say its allocation was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `AccumulateGrad`: a gradient.
    Gradient,
    /// cuBLAS workspaces, NCCL and c10d (DDP's buckets), CUDA graphs.
    Library,
    /// An optimizer's code: its step or its state's initialisation.
    Optimizer,
    /// Autograd's engine or a backward node, or `loss.backward()` itself.
    Backward,
    /// The data loader or a trainer moving the batch to the device.
    Input,
    /// Building, moving or loading the model: `Module._apply`, `load_state_dict`, `nn` constructors.
    Parameter,
    /// Any other Python frame or operator: forward, loss, metrics.
    Forward,
    /// No frame that says anything: stacks were off, or only the allocator's own frames.
    Bare,
}

/// The kind of every stack of a snapshot.
pub(crate) struct Kinds {
    /// By [`StackId`].
    pub(crate) of: Vec<Kind>,
    /// The file has Python stacks and no native frame at all (recorded
    /// with `stacks="python"`, or on Windows): a traced allocation without
    /// frames then came from a thread that runs no Python, which during
    /// training is autograd's engine running backward.
    pub(crate) empty_is_backward: bool,
    /// What freeing a block from a stack says it was, by [`StackId`]:
    /// the free's own frames.
    pub(crate) freed_by: Vec<FreedBy>,
}

/// What the code that freed a block says it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreedBy {
    /// Nothing in particular.
    Other,
    /// `Optimizer.zero_grad`: a gradient.
    ZeroGrad,
    /// The optimizer's step: its state, replaced by new tensors.
    Optimizer,
}

/// Finds the kind of every stack of a snapshot. Each distinct frame is
/// looked at once (a file has hundreds of frames in thousands of stacks).
pub(crate) fn kinds(stacks: &Stacks) -> Kinds {
    let flags: Vec<u16> = (0..stacks.frame_count())
        .map(|f| frame_flags(stacks.frame(f as FrameId)))
        .collect();
    let (mut python, mut native) = (false, false);
    let mut freed_by = Vec::with_capacity(stacks.len());
    let of = (0..stacks.len())
        .map(|i| {
            let all = stack_flags(
                stacks
                    .stack(StackId(i as u32))
                    .iter()
                    .map(|&f| flags[f as usize]),
            );
            python |= all & PYTHON != 0;
            native |= all & NATIVE != 0;
            freed_by.push(if all & ZERO_GRAD != 0 {
                FreedBy::ZeroGrad
            } else if all & OPTIMIZER != 0 {
                FreedBy::Optimizer
            } else {
                FreedBy::Other
            });
            kind_of(all)
        })
        .collect();
    Kinds {
        of,
        empty_is_backward: python && !native,
        freed_by,
    }
}

// What one frame says, as bits: its language and the kinds it names.
const PYTHON: u16 = 1;
const NATIVE: u16 = 1 << 1;
const GRADIENT: u16 = 1 << 2;
const LIBRARY: u16 = 1 << 3;
const OPTIMIZER: u16 = 1 << 4;
const BACKWARD: u16 = 1 << 5;
const INPUT: u16 = 1 << 6;
const PARAMETER: u16 = 1 << 7;
/// A native frame naming an operator (`at::_ops::mm`): forward work where
/// nothing else claims the stack.
const OPERATOR: u16 = 1 << 8;
/// `Optimizer.zero_grad` (or a model's): what frees there is a gradient.
const ZERO_GRAD: u16 = 1 << 9;
/// A Python constructor (`__init__`).
const CONSTRUCTOR: u16 = 1 << 10;
/// A module being called (`Module._call_impl`, a `forward`): forward work,
/// even inside a constructor it runs (a distribution built in `forward`).
const MODULE_CALL: u16 = 1 << 11;
/// Set on a stack, not a frame: constructors nested [`NESTED_CONSTRUCTORS`]
/// deep with no module call above them, a model building its layers' own
/// weights (a project's or a library's layer that makes
/// `nn.Parameter(torch.empty(...))`, as transformers' `Conv1D`).
const MODULE_BUILD: u16 = 1 << 12;

/// Constructors inside constructors: a model, its blocks, their layers.
const NESTED_CONSTRUCTORS: usize = 2;

fn frame_flags(f: &Frame) -> u16 {
    let mut b = if is_python(f) { PYTHON } else { NATIVE };
    let set = |b: &mut u16, bit: u16, on: bool| {
        if on {
            *b |= bit
        }
    };
    set(&mut b, GRADIENT, f.name.contains("AccumulateGrad"));
    set(&mut b, LIBRARY, is_library_buffer(f));
    set(
        &mut b,
        OPTIMIZER,
        is_python(f) && is_optimizer_path(&f.filename),
    );
    set(&mut b, BACKWARD, is_backward(f));
    set(&mut b, INPUT, is_input(f));
    set(&mut b, PARAMETER, is_parameter(f));
    set(
        &mut b,
        OPERATOR,
        !is_python(f) && f.name.contains("at::_ops::"),
    );
    set(&mut b, ZERO_GRAD, is_python(f) && f.name == "zero_grad");
    set(&mut b, CONSTRUCTOR, is_python(f) && f.name == "__init__");
    set(
        &mut b,
        MODULE_CALL,
        is_python(f)
            && matches!(
                f.name.as_str(),
                "_call_impl" | "_wrapped_call_impl" | "forward"
            ),
    );
    b
}

/// The bits of a stack: its frames' together, and [`MODULE_BUILD`] where
/// constructors nest (one object's constructor alone says nothing).
fn stack_flags(frames: impl Iterator<Item = u16>) -> u16 {
    let (mut all, mut constructors) = (0u16, 0usize);
    for f in frames {
        all |= f;
        constructors += usize::from(f & CONSTRUCTOR != 0);
    }
    if constructors >= NESTED_CONSTRUCTORS {
        all |= MODULE_BUILD;
    }
    all
}

/// Decides a stack's kind from its frames' bits; the order matters: an
/// optimizer step run from a backward hook is the optimizer's, a
/// recomputation under activation checkpointing is backward work.
fn kind_of(all: u16) -> Kind {
    if all & GRADIENT != 0 {
        Kind::Gradient
    } else if all & LIBRARY != 0 {
        Kind::Library
    } else if all & OPTIMIZER != 0 {
        Kind::Optimizer
    } else if all & BACKWARD != 0 {
        Kind::Backward
    } else if all & INPUT != 0 {
        Kind::Input
    } else if all & PARAMETER != 0 || (all & MODULE_BUILD != 0 && all & MODULE_CALL == 0) {
        Kind::Parameter
    } else if all & (PYTHON | OPERATOR) != 0 {
        Kind::Forward
    } else {
        Kind::Bare
    }
}

fn is_python(f: &Frame) -> bool {
    f.filename.ends_with(".py")
}

fn path(f: &Frame) -> String {
    f.filename.replace('\\', "/")
}

fn is_library_buffer(f: &Frame) -> bool {
    const NAMES: [&str; 7] = [
        "getNewWorkspace",
        "BlasLtWorkspace",
        "getCurrentCUDABlasHandle",
        "c10d::",
        "ProcessGroupNCCL",
        "ncclComm",
        "CUDAGraph",
    ];
    !is_python(f) && NAMES.iter().any(|n| f.name.contains(n))
}

/// A file of an optimizer: `torch/optim/`, `bitsandbytes/optim/`, a
/// project's own `optimizer.py`, DeepSpeed's `fused_adam.py`.
fn is_optimizer_path(filename: &str) -> bool {
    filename
        .replace('\\', "/")
        .to_ascii_lowercase()
        .split('/')
        .any(|seg| {
            let stem = seg.strip_suffix(".py").unwrap_or(seg);
            (stem.starts_with("optim") && !stem.starts_with("optimum"))
                || stem.ends_with("_optim")
                || stem.ends_with("optimizer")
                || stem.ends_with("optimizers")
                || stem.contains("adam")
        })
}

fn is_backward(f: &Frame) -> bool {
    if is_python(f) {
        return matches!(
            f.name.as_str(),
            "backward" | "_make_grads" | "_engine_run_backward"
        );
    }
    let n = &f.name;
    n.contains("torch::autograd::Engine::")
        || (n.contains("torch::autograd::")
            && n.contains("Backward")
            && !n.contains("VariableType"))
}

fn is_input(f: &Frame) -> bool {
    const CALLS: [&str; 6] = [
        "_prepare_input",
        "_prepare_inputs",
        "send_to_device",
        "move_data_to_device",
        "transfer_batch_to_device",
        "pin_memory",
    ];
    is_python(f) && (path(f).contains("/torch/utils/data/") || CALLS.contains(&f.name.as_str()))
}

fn is_parameter(f: &Frame) -> bool {
    // PyTorch's own loading and moving, and the model loaders above it
    // (transformers', diffusers' and PEFT's `from_pretrained`, accelerate's
    // big-model loading), which allocate the weights wherever they put them.
    const CALLS: [&str; 11] = [
        "_apply",
        "load_state_dict",
        "_load_from_state_dict",
        "to_empty",
        "reset_parameters",
        "_load_state_dict_into_meta_model",
        "set_module_tensor_to_device",
        "from_pretrained",
        "load_checkpoint_in_model",
        "load_checkpoint_and_dispatch",
        "dispatch_model",
    ];
    if !is_python(f) {
        return false;
    }
    let p = path(f);
    CALLS.contains(&f.name.as_str())
        || (p.contains("/torch/nn/modules/") && f.name == "__init__")
        || p.ends_with("/torch/nn/init.py")
        || p.ends_with("/torch/nn/parameter.py")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(filename: &str, name: &str) -> Frame {
        Frame {
            filename: filename.into(),
            line: 1,
            name: name.into(),
        }
    }

    fn kind(frames: &[(&str, &str)]) -> Kind {
        kind_of(stack_flags(
            frames.iter().map(|(p, n)| frame_flags(&frame(p, n))),
        ))
    }

    #[test]
    fn frames_name_the_kind() {
        let engine = ("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)");
        assert_eq!(
            kind(&[
                (
                    "accumulate_grad.cpp",
                    "torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)"
                ),
                engine
            ]),
            Kind::Gradient
        );
        assert_eq!(
            kind(&[("Functions.cpp", "torch::autograd::generated::MulBackward0_apply_functional(std::vector<at::Tensor>)"), engine]),
            Kind::Backward
        );
        // A forward op dispatches through VariableType, which is not backward work.
        assert_eq!(
            kind(&[
                ("VariableType_0.cpp", "torch::autograd::VariableType::(anonymous namespace)::mul_Tensor(c10::DispatchKeySet)"),
                ("/home/me/model.py", "forward"),
            ]),
            Kind::Forward
        );
        assert_eq!(
            kind(&[
                ("/home/me/cs336_basics/optimizer.py", "step"),
                (
                    "/venv/lib/python3.12/site-packages/torch/optim/optimizer.py",
                    "wrapper"
                ),
            ]),
            Kind::Optimizer
        );
        assert_eq!(
            kind(&[
                ("/venv/site-packages/torch/nn/modules/module.py", "_apply"),
                ("/home/me/train.py", "main"),
            ]),
            Kind::Parameter
        );
        assert_eq!(
            kind(&[(
                "/venv/site-packages/torch/utils/data/_utils/pin_memory.py",
                "pin_memory"
            ),]),
            Kind::Input
        );
        // A layer of another package making its own weights (transformers' Conv1D)...
        assert_eq!(
            kind(&[
                (
                    "/venv/site-packages/transformers/pytorch_utils.py",
                    "__init__"
                ),
                (
                    "/venv/site-packages/transformers/models/gpt2/modeling_gpt2.py",
                    "__init__"
                ),
                ("/home/me/train.py", "main"),
            ]),
            Kind::Parameter
        );
        // ...but one object's constructor says nothing, and an object built
        // inside a forward is forward work.
        assert_eq!(
            kind(&[
                ("/home/me/guide.py", "__init__"),
                ("/home/me/main.py", "<module>")
            ]),
            Kind::Forward
        );
        assert_eq!(
            kind(&[
                (
                    "/venv/site-packages/torch/distributions/normal.py",
                    "__init__"
                ),
                ("/home/me/model.py", "forward"),
                (
                    "/venv/site-packages/torch/nn/modules/module.py",
                    "_call_impl"
                ),
                ("/home/me/train.py", "main"),
            ]),
            Kind::Forward
        );
        // A model loaded straight onto the GPU, by whatever the loader calls below it.
        assert_eq!(
            kind(&[
                ("/venv/site-packages/safetensors/torch.py", "load_file"),
                (
                    "/venv/site-packages/transformers/modeling_utils.py",
                    "from_pretrained"
                ),
                ("/home/me/train.py", "main"),
            ]),
            Kind::Parameter
        );
        assert_eq!(
            kind(&[
                ("??", "at::cuda::getCurrentCUDABlasHandle()"),
                ("/home/me/model.py", "forward")
            ]),
            Kind::Library
        );
        assert_eq!(kind(&[("CUDACachingAllocator.cpp", "malloc")]), Kind::Bare);
        assert_eq!(kind(&[]), Kind::Bare);
        // HF optimum is not an optimizer.
        assert!(!is_optimizer_path(
            "/venv/site-packages/optimum/exporters/onnx.py"
        ));
        assert!(is_optimizer_path(
            "/venv/site-packages/deepspeed/ops/adam/fused_adam.py"
        ));
    }
}
