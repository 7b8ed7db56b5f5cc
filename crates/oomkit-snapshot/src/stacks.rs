//! Interned frames and stacks, and the choice of an allocation's user frame.

use serde::Serialize;
use std::collections::HashMap;

/// One frame of a captured traceback.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Frame {
    /// Source file, `??` or empty for native frames without symbols.
    pub filename: String,
    /// Line number, 0 for native frames.
    pub line: i64,
    /// Function name.
    pub name: String,
}

/// Index of a frame in [`Stacks`].
pub type FrameId = u32;
/// Index of a stack in [`Stacks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackId(pub u32);

impl StackId {
    /// The empty stack: no frames were recorded.
    pub const EMPTY: StackId = StackId(0);
}

/// What kind of code a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameClass {
    /// C, C++ or CUDA code, or a frame without a source file.
    Native,
    /// The Python interpreter or its standard library.
    Runtime,
    /// PyTorch itself.
    Torch,
    /// A third-party package installed in site-packages.
    Library,
    /// Anything else: the user's own code.
    User,
}

/// Marks of code PyTorch's compilers generate: an FX graph's `forward`
/// (`<eval_with_key>.3`), and inductor's output code, written under
/// `torchinductor_<user>/` in the temporary folder. Neither is the user's
/// line, though neither lives under `torch/`.
const GENERATED_BY_TORCH: [&str; 2] = ["<eval_with_key>", "/torchinductor_"];

/// Classifies a frame so that torch internals, the runtime and native code
/// can be skipped when looking for the line that asked for memory.
pub fn classify(frame: &Frame) -> FrameClass {
    let f = frame.filename.as_str();
    let python = f.ends_with(".py") || f.starts_with('<');
    if !python {
        return FrameClass::Native;
    }
    if f.starts_with("<frozen") {
        return FrameClass::Runtime;
    }
    let f = f.replace('\\', "/");
    if f.contains("/torch/")
        || f.starts_with("torch/")
        || f.contains("/functorch/")
        || GENERATED_BY_TORCH.iter().any(|g| f.contains(g))
    {
        return FrameClass::Torch;
    }
    if f.contains("/site-packages/") || f.contains("/dist-packages/") {
        return FrameClass::Library;
    }
    if f.contains("/lib/python3") || f.contains("/lib/python2") || f.contains("/Lib/") {
        return FrameClass::Runtime;
    }
    FrameClass::User
}

/// All distinct frames and stacks of a snapshot; stack 0 is the empty stack.
#[derive(Debug)]
pub struct Stacks {
    frames: Vec<Frame>,
    frame_ids: HashMap<Frame, FrameId>,
    stacks: Vec<Vec<FrameId>>,
    stack_ids: HashMap<Vec<FrameId>, StackId>,
    sites: Vec<Site>,
    native_names: Vec<String>,
}

/// Where an allocation came from, as far as its stack tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Site {
    /// A Python frame: the user's line, else a library's, else torch's.
    Frame(FrameId),
    /// No Python frame, but a native operation: an autograd node such as
    /// `MmBackward0` (memory allocated during backward) or an aten op.
    Native(u32),
    /// Only allocator and runtime frames.
    Unknown,
}

/// Names the native operation in a stack without Python frames.
fn native_op(frames: &[&Frame]) -> Option<String> {
    // Backward allocations run on autograd's own thread: the node names the
    // op (MmBackward0), or AccumulateGrad for the gradients themselves.
    for f in frames {
        if let Some(path) = f.name.strip_prefix("torch::autograd::") {
            if let Some((head, _)) = path.split_once("::apply(") {
                let node = head.rsplit("::").next().unwrap_or(head);
                return Some(format!("backward: {node}"));
            }
        }
    }
    frames.iter().find_map(|f| {
        let rest = f.name.split("at::_ops::").nth(1)?;
        let op = rest.split("::").next()?;
        Some(format!("aten::{op}"))
    })
}

impl Default for Stacks {
    fn default() -> Self {
        let mut s = Stacks {
            frames: Vec::new(),
            frame_ids: HashMap::new(),
            stacks: Vec::new(),
            stack_ids: HashMap::new(),
            sites: Vec::new(),
            native_names: Vec::new(),
        };
        s.intern_stack(Vec::new());
        s
    }
}

impl Stacks {
    /// Returns the id of a frame, adding it if new.
    pub fn intern_frame(&mut self, frame: Frame) -> FrameId {
        if let Some(&id) = self.frame_ids.get(&frame) {
            return id;
        }
        let id = self.frames.len() as FrameId;
        self.frames.push(frame.clone());
        self.frame_ids.insert(frame, id);
        id
    }

    /// Returns the id of a stack (innermost frame first), adding it if new.
    pub fn intern_stack(&mut self, frames: Vec<FrameId>) -> StackId {
        if let Some(&id) = self.stack_ids.get(&frames) {
            return id;
        }
        let id = StackId(self.stacks.len() as u32);
        let site = frames
            .iter()
            .copied()
            .map(|f| (f, classify(&self.frames[f as usize])))
            .min_by_key(|&(_, c)| match c {
                FrameClass::User => 0,
                FrameClass::Library => 1,
                FrameClass::Torch => 2,
                FrameClass::Runtime => 3,
                FrameClass::Native => 4,
            })
            .filter(|&(_, c)| c != FrameClass::Native)
            .map(|(f, _)| f);
        let site = match site {
            Some(f) => Site::Frame(f),
            None => {
                let fr: Vec<&Frame> = frames.iter().map(|&f| &self.frames[f as usize]).collect();
                match native_op(&fr) {
                    Some(name) => {
                        let i = match self.native_names.iter().position(|n| *n == name) {
                            Some(i) => i,
                            None => {
                                self.native_names.push(name);
                                self.native_names.len() - 1
                            }
                        };
                        Site::Native(i as u32)
                    }
                    None => Site::Unknown,
                }
            }
        };
        self.sites.push(site);
        self.stacks.push(frames.clone());
        self.stack_ids.insert(frames, id);
        id
    }

    /// Returns a frame by id.
    pub fn frame(&self, id: FrameId) -> &Frame {
        &self.frames[id as usize]
    }

    /// Returns the frames of a stack, innermost first.
    pub fn stack(&self, id: StackId) -> &[FrameId] {
        &self.stacks[id.0 as usize]
    }

    /// Returns the number of distinct frames; their ids are `0..frame_count()`.
    pub fn frame_count(&self) -> usize {
        self.frames.len()
    }

    /// Returns the number of distinct stacks, the empty one included.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// Returns true when only the empty stack exists.
    pub fn is_empty(&self) -> bool {
        self.stacks.len() == 1
    }

    /// Returns where the memory was asked for: the innermost frame of the
    /// user's own code, else of a library, else of torch's Python code;
    /// for native-only stacks, the native operation.
    pub fn site(&self, id: StackId) -> Site {
        self.sites[id.0 as usize]
    }

    /// Returns the description of a [`Site::Native`] site.
    pub fn native_name(&self, i: u32) -> &str {
        &self.native_names[i as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(filename: &str, line: i64, name: &str) -> Frame {
        Frame {
            filename: filename.into(),
            line,
            name: name.into(),
        }
    }

    #[test]
    fn code_torch_generates_is_torch_not_the_user() {
        for generated in [
            "<eval_with_key>.3",
            "/tmp/torchinductor_me/ab/cabxyz.py",
            "C:\\Users\\me\\AppData\\Local\\Temp\\torchinductor_me\\x.py",
        ] {
            assert_eq!(
                classify(&f(generated, 12, "forward")),
                FrameClass::Torch,
                "{generated}"
            );
        }
        assert_eq!(
            classify(&f("/tmp/job/model.py", 5, "forward")),
            FrameClass::User
        );
    }

    #[test]
    fn site_skips_native_torch_and_runtime_frames() {
        let mut s = Stacks::default();
        let frames = vec![
            f("??", 0, "torch::unwind::unwind()"),
            f("CUDACachingAllocator.cpp", 0, "malloc"),
            f(
                "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py",
                1790,
                "_call_impl",
            ),
            f("/usr/lib/python3.12/contextlib.py", 81, "inner"),
            f(
                "/venv/lib/python3.12/site-packages/einops/einops.py",
                916,
                "einsum",
            ),
            f("/home/me/model.py", 54, "forward"),
            f("/home/me/train.py", 10, "<module>"),
        ];
        let ids: Vec<_> = frames.into_iter().map(|x| s.intern_frame(x)).collect();
        let st = s.intern_stack(ids.clone());
        let frame = |s: &Stacks, site| match site {
            Site::Frame(f) => s.frame(f).clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(frame(&s, s.site(st)).line, 54);
        let lib_only = s.intern_stack(ids[..5].to_vec());
        assert_eq!(frame(&s, s.site(lib_only)).name, "einsum");
        let native = s.intern_stack(ids[..2].to_vec());
        assert_eq!(s.site(native), Site::Unknown);
        assert_eq!(s.site(StackId::EMPTY), Site::Unknown);
        assert_eq!(s.intern_stack(ids), st, "stacks are interned by content");
    }

    #[test]
    fn native_stacks_are_named_by_autograd_node_or_aten_op() {
        let mut s = Stacks::default();
        let backward = vec![
            f("??", 0, "at::_ops::bmm::call(at::Tensor const&, at::Tensor const&)"),
            f("??", 0, "torch::autograd::generated::BmmBackward0::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)"),
            f("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
        ];
        let ids: Vec<_> = backward.into_iter().map(|x| s.intern_frame(x)).collect();
        let b = s.intern_stack(ids.clone());
        let Site::Native(i) = s.site(b) else { panic!() };
        assert_eq!(s.native_name(i), "backward: BmmBackward0");
        let op = s.intern_stack(ids[..1].to_vec());
        let Site::Native(i) = s.site(op) else {
            panic!()
        };
        assert_eq!(s.native_name(i), "aten::bmm");
    }
}
