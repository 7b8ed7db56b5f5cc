//! The role of every live block (parameters, gradients, optimizer state,
//! activations, temporaries, inputs, other or unknown), told by the frames
//! that allocated it, by its lifetime against forward and backward, or, for
//! blocks allocated before recording, by matching their sizes with the
//! gradients'.

use crate::frame_kinds::{FreedBy, Kind, Kinds};
use crate::hash::FastState;
use crate::model::{Action, TraceEvent};
use crate::replay::{TraceScan, Window};
use crate::report::UnknownReason;
use crate::sites::Live;
use crate::stacks::StackId;
use oomkit_advice::{Evidence, Role, RolesAt};
use std::collections::HashMap;

/// The most state tensors the size match gives a parameter: Adam's two moments.
pub(crate) const MAX_STATES_PER_PARAM: u32 = 2;

/// Above this share of a moment's bytes in `unknown`, the analysis warns and says why.
pub(crate) const UNKNOWN_WARN_SHARE: f64 = 0.25;

/// What one block is, before the blocks matched by size are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    Known(Role, Evidence),
    /// Left to the size match; `survives` when it is never freed.
    BySize {
        survives: bool,
    },
    Unknown(UnknownReason),
}

/// Packs a traced allocation's [`Told`] into one byte, so that a trace of
/// millions of entries keeps one byte each.
fn pack(t: Told) -> u8 {
    match t {
        Told::Known(r, e) => (r as u8) << 2 | (e as u8),
        Told::BySize { survives } => 0x80 | survives as u8,
        Told::Unknown(w) => 0x40 | w as u8,
    }
}

fn unpack(b: u8) -> Told {
    if b & 0x80 != 0 {
        Told::BySize {
            survives: b & 1 == 1,
        }
    } else if b & 0x40 != 0 {
        Told::Unknown(UnknownReason::ALL[(b & 0x7) as usize])
    } else {
        let e = [Evidence::Frames, Evidence::Lifetimes, Evidence::Sizes][(b & 0x3) as usize];
        Told::Known(Role::ALL[(b >> 2) as usize], e)
    }
}

/// The roles of one device's allocations, ready to count at any moment.
pub(crate) struct DeviceRoles<'a> {
    kinds: &'a Kinds,
    events: &'a [TraceEvent],
    /// Per trace entry: the packed [`Told`] of each allocation.
    told: Vec<u8>,
    /// How many gradients of each size were alive at once, at most.
    grads: HashMap<u64, u32, FastState>,
    /// Optimizer state tensors per parameter, as the sizes show (0 to [`MAX_STATES_PER_PARAM`]).
    states_per_param: u32,
    /// Whether anything shows an optimizer: its frames or its `Optimizer.step` range.
    optimizer_seen: bool,
    /// Whether anything shows training: backward frames or gradients.
    training: bool,
    /// A trace of forward work alone, without gradients or an optimizer
    /// step: what was allocated before it and outlives it is the model.
    forward_only: bool,
    /// Whether the blocks that outlive a forward-only trace come in threes
    /// per size, which parameters with Adam's state would do too.
    state_like: bool,
    /// For sizes with no gradient in the trace: how many parameters keep a
    /// gradient from before it, accumulated in place (see [`in_place`]).
    in_place: HashMap<u64, u32, FastState>,
}

/// What a device says about its trace besides the trace itself: its
/// `record_function` ranges and its private pools.
#[derive(Default)]
pub(crate) struct Context {
    /// The entries of the `Optimizer.step` ranges.
    pub(crate) optimizer_steps: Vec<Window>,
    /// The entries of ranges named for evaluation.
    pub(crate) evals: Vec<Window>,
    /// Whether any optimizer range (`zero_grad` too) was recorded.
    pub(crate) has_optimizer: bool,
    /// The address ranges of the private-pool segments, sorted.
    pub(crate) private: Vec<(u64, u64)>,
}

/// One moment's roles, with the reasons for what stayed unknown.
pub(crate) struct Moment {
    pub(crate) roles: RolesAt,
    /// Bytes left unknown, by reason.
    pub(crate) unknown: [(UnknownReason, u64); UnknownReason::ALL.len()],
}

impl Moment {
    /// Counts bytes that no block accounts for as unknown.
    pub(crate) fn add_unlisted(&mut self, bytes: u64) {
        self.roles.add(Role::Unknown, bytes, None);
        self.unknown[UnknownReason::NoEvidence as usize].1 += bytes;
    }

    /// The reason for most of the unknown bytes, if any are.
    pub(crate) fn main_reason(&self) -> Option<UnknownReason> {
        self.unknown
            .iter()
            .filter(|(_, b)| *b > 0)
            .max_by_key(|(_, b)| *b)
            .map(|(w, _)| *w)
    }
}

/// Sizes holding less than this share of the blocks' bytes do not count
/// when telling parameters with Adam's state from parameters alone.
const THREES_MIN_SHARE: f64 = 0.01;

/// Whether every size that holds a real share of these blocks' bytes has a
/// count divisible by three (at least two such sizes): parameters with two
/// state tensors each look like that, parameters alone rarely do (one
/// embedding, or two with an untied head, break the pattern).
fn in_threes<'l>(blocks: impl Iterator<Item = &'l Live>) -> bool {
    let mut by_size: HashMap<u64, (u64, u64), FastState> = HashMap::default();
    for l in blocks {
        let e = by_size.entry(l.requested).or_default();
        e.0 += 1;
        e.1 += l.size;
    }
    let total: u64 = by_size.values().map(|e| e.1).sum();
    let large: Vec<u64> = by_size
        .values()
        .filter(|e| e.1 as f64 >= THREES_MIN_SHARE * total as f64)
        .map(|e| e.0)
        .collect();
    large.len() >= 2 && large.iter().all(|n| n % 3 == 0)
}

/// The latest entries of each kind of work before the current one, as the
/// single pass over a trace goes: a mark after an allocation's start means
/// that work came while it lived.
#[derive(Clone, Copy, Default)]
struct Marks {
    /// Forward or backward work (an allocation of it).
    model: Option<u32>,
    /// Backward work.
    backward: Option<u32>,
    /// Work other than backward: forward, inputs, the optimizer.
    other: Option<u32>,
    /// An OOM entry.
    oom: Option<u32>,
    /// For a backward allocation being decided: whether it outlived its pass.
    outlives_pass: bool,
}

/// The end of an allocation that is never freed.
const NEVER: u32 = u32::MAX;

/// What deciding an allocation's role needs of the whole trace, and what it
/// has decided so far.
struct Decider<'a> {
    events: &'a [TraceEvent],
    kinds: &'a Kinds,
    context: &'a Context,
    /// Whether the file's stacks show training (an optimizer, a backward, gradients).
    trains_by_stacks: bool,
    /// Per trace entry: the packed [`Told`] of each allocation.
    told: Vec<u8>,
    /// The gradients the trace allocates: (entry, end, size).
    grad_allocs: Vec<(u32, u32, u64)>,
    /// Per size, the parameters freed by optimizer code, in trace order:
    /// (the free's entry, the latest model work then). A step that
    /// replaces its weights (`p.data = p.data - lr * p.grad`) allocates the
    /// new weight, then frees the old one of the same size.
    replaced: HashMap<u64, Vec<(u32, Option<u32>)>, FastState>,
    /// Per size, the most backward results one pass freed within it.
    pass_results: HashMap<u64, u32, FastState>,
}

/// What walking the trace saw, besides each allocation's role.
struct Walked {
    marks: Marks,
    forward_work: bool,
    optimizer_work: bool,
}

impl Decider<'_> {
    /// The kind of the stack that allocated entry `i`.
    fn kind(&self, i: usize) -> Kind {
        match self.events[i].stack {
            StackId::EMPTY if self.kinds.empty_is_backward => Kind::Backward,
            s => self.kinds.of[s.0 as usize],
        }
    }

    /// Decides the allocation at entry `a`, ended at `f` (or [`NEVER`]),
    /// from the latest marks of each kind of work at its end.
    fn decide(&mut self, a: u32, f: u32, marks: &Marks) {
        let i = a as usize;
        let within = |w: &[Window]| w.iter().any(|&(s, e)| s <= i && i < e);
        let trains = self.trains_by_stacks || marks.backward.is_some();
        let after = |m: Option<u32>| m.is_some_and(|m| m > a);
        let outlives_step = f == NEVER || after(marks.model);
        let addr = self.events[i].addr;
        let private = &self.context.private;
        // A CUDA graph's pool: the graph's own memory, whatever ran in it.
        let in_private = !private.is_empty() && {
            let k = private.partition_point(|&(start, _)| start <= addr);
            k > 0 && addr < private[k - 1].1
        };
        // Asked only in the arms that need them: each is a scan of the ranges.
        let in_eval = || within(&self.context.evals);
        let in_optimizer = || within(&self.context.optimizer_steps);
        let t = match self.kind(i) {
            _ if in_private => Told::Known(Role::Other, Evidence::Frames),
            Kind::Gradient => Told::Known(Role::Gradients, Evidence::Frames),
            Kind::Library => Told::Known(Role::Other, Evidence::Frames),
            Kind::Input => Told::Known(Role::Inputs, Evidence::Frames),
            Kind::Parameter => Told::Known(Role::Parameters, Evidence::Frames),
            // A weight the step made to replace one of the same size, freed
            // after it in the same step, is a parameter, not state.
            Kind::Optimizer if outlives_step && self.replaces_a_parameter(a) => {
                Told::Known(Role::Parameters, Evidence::Lifetimes)
            }
            Kind::Optimizer if outlives_step => Told::Known(Role::OptimizerState, Evidence::Frames),
            Kind::Optimizer => Told::Known(Role::Temporaries, Evidence::Lifetimes),
            // A backward result that outlives its backward pass was
            // taken over as a gradient (an embedding's, or every one
            // under torch.compile, whose backward hands its outputs
            // over); `Marks::outlives_pass` says whether it did.
            Kind::Backward if f == NEVER || marks.outlives_pass => {
                Told::Known(Role::Gradients, Evidence::Lifetimes)
            }
            Kind::Backward => Told::Known(Role::Temporaries, Evidence::Lifetimes),
            Kind::Forward if f == NEVER => {
                if in_eval() {
                    Told::Unknown(UnknownReason::HeldAfterEval)
                } else if after(marks.backward) {
                    Told::Unknown(UnknownReason::HeldPastBackward)
                } else if trains {
                    // The forward in progress when the snapshot was taken.
                    Told::Known(Role::Activations, Evidence::Lifetimes)
                } else {
                    Told::Unknown(UnknownReason::NoBackward)
                }
            }
            // Kept for a backward, or for one an OOM cancelled: the
            // step's tensors are freed only as the error unwinds.
            Kind::Forward
                if after(marks.backward) || (trains && !in_eval() && after(marks.oom)) =>
            {
                Told::Known(Role::Activations, Evidence::Lifetimes)
            }
            Kind::Forward => Told::Known(Role::Temporaries, Evidence::Lifetimes),
            Kind::Bare if in_optimizer() && outlives_step => {
                Told::Known(Role::OptimizerState, Evidence::Lifetimes)
            }
            Kind::Bare if in_optimizer() => Told::Known(Role::Temporaries, Evidence::Lifetimes),
            Kind::Bare => Told::BySize {
                survives: f == NEVER,
            },
        };
        if let Told::Known(Role::Gradients, _) = t {
            self.grad_allocs.push((a, f, self.events[i].size));
        }
        self.told[i] = pack(t);
    }

    /// Whether optimizer code freed a parameter of the allocation's size
    /// after it (`a`), with no model work in between: the same step put it
    /// in that parameter's place.
    fn replaces_a_parameter(&self, a: u32) -> bool {
        let Some(frees) = self.replaced.get(&self.events[a as usize].size) else {
            return false;
        };
        let k = frees.partition_point(|&(j, _)| j <= a);
        frees
            .get(k)
            .is_some_and(|&(_, model)| model.is_none_or(|m| m < a))
    }

    /// Notes a parameter that optimizer code freed at entry `i`.
    fn note_replaced(&mut self, a: u32, i: u32, marks: &Marks) {
        let is_param = matches!(
            unpack(self.told[a as usize]),
            Told::Known(Role::Parameters, _)
        );
        if is_param && self.kind(i as usize) == Kind::Optimizer {
            let size = self.events[a as usize].size;
            self.replaced
                .entry(size)
                .or_default()
                .push((i, marks.model));
        }
    }

    /// Decides the backward allocations that ended within the pass that
    /// ends now (`pass_last` its last backward allocation): they outlived it
    /// if no backward allocation came after them.
    fn end_pass(&mut self, pending: &mut Vec<(u32, u32)>, pass_last: Option<u32>, marks: &Marks) {
        let mut this_pass: HashMap<u64, u32, FastState> = HashMap::default();
        for (a, f) in pending.drain(..) {
            let m = Marks {
                outlives_pass: pass_last.is_none_or(|l| f > l),
                ..*marks
            };
            self.decide(a, f, &m);
            if unpack(self.told[a as usize]) == Told::Known(Role::Temporaries, Evidence::Lifetimes)
            {
                *this_pass.entry(self.events[a as usize].size).or_default() += 1;
            }
        }
        for (size, n) in this_pass {
            let most = self.pass_results.entry(size).or_default();
            *most = (*most).max(n);
        }
    }

    /// One pass over the trace: each allocation is decided when it ends,
    /// from what happened between its start and its end, which the latest
    /// marks tell (a mark after the start means one in between). No table
    /// of ends or of marks, which on a long trace would be megabytes of
    /// fresh pages.
    fn walk(&mut self, scan: &TraceScan) -> Walked {
        let mut marks = Marks::default();
        let (mut optimizer_work, mut forward_work) = (false, false);
        // Backward allocations that ended within their pass, decided when it ends.
        let mut pending: Vec<(u32, u32)> = Vec::new();
        let mut pass_last: Option<u32> = None;
        for (i, e) in self.events.iter().enumerate() {
            let i32 = i as u32;
            // What ends here: a free, or an allocation over a held address.
            if let Some(a) = scan.link[i].checked_sub(1) {
                if self.kind(a as usize) == Kind::Backward && marks.other.is_none_or(|o| o <= a) {
                    pending.push((a, i32));
                } else {
                    // Other work came between: it outlived its pass.
                    let m = Marks {
                        outlives_pass: true,
                        ..marks
                    };
                    self.decide(a, i32, &m);
                    self.note_replaced(a, i32, &marks);
                }
            }
            match e.action {
                Action::Oom => marks.oom = Some(i32),
                Action::Alloc => match self.kind(i) {
                    Kind::Backward | Kind::Gradient => {
                        marks.model = Some(i32);
                        marks.backward = Some(i32);
                        pass_last = Some(i32);
                    }
                    // Other work ends the backward pass in progress.
                    k @ (Kind::Forward | Kind::Input | Kind::Optimizer) => {
                        forward_work |= k == Kind::Forward;
                        optimizer_work |= k == Kind::Optimizer;
                        self.end_pass(&mut pending, pass_last, &marks);
                        pass_last = None;
                        marks.other = Some(i32);
                        if k != Kind::Optimizer {
                            marks.model = Some(i32);
                        }
                    }
                    _ => {}
                },
                _ => {}
            }
        }
        self.end_pass(&mut pending, pass_last, &marks);
        // What never ended, against everything after it.
        let mut open: Vec<u32> = scan.open.values().copied().collect();
        open.sort_unstable();
        for a in open {
            self.decide(a, NEVER, &marks);
        }
        Walked {
            marks,
            forward_work,
            optimizer_work,
        }
    }
}

impl<'a> DeviceRoles<'a> {
    /// Decides every allocation of a trace. `before` are the blocks alive
    /// before the trace and still alive at its end; `end` every block alive
    /// at snapshot time.
    pub(crate) fn new(
        all_kinds: &'a Kinds,
        events: &'a [TraceEvent],
        scan: &TraceScan,
        context: &Context,
        before: &[Live],
        end: &[Live],
    ) -> Self {
        let kinds = &all_kinds.of[..];
        // A run with an optimizer or a backward trains, so its forward
        // keeps activations: known from the file's stacks (the blocks' as
        // well as the trace's) and ranges before the pass, and from the
        // trace's own backward as it goes.
        let trains_by_stacks = context.has_optimizer
            || kinds
                .iter()
                .any(|k| matches!(k, Kind::Backward | Kind::Gradient | Kind::Optimizer));
        let mut decider = Decider {
            events,
            kinds: all_kinds,
            context,
            trains_by_stacks,
            told: vec![0u8; events.len()],
            grad_allocs: Vec::new(),
            replaced: HashMap::default(),
            pass_results: HashMap::default(),
        };
        let walked = decider.walk(scan);
        let backward_work = walked.marks.backward.is_some();
        let trains = trains_by_stacks || backward_work;
        let optimizer_seen = !context.optimizer_steps.is_empty()
            || walked.optimizer_work
            || end
                .iter()
                .any(|l| kinds[l.stack.0 as usize] == Kind::Optimizer);
        let Decider {
            told,
            mut grad_allocs,
            pass_results,
            ..
        } = decider;
        let mut roles = DeviceRoles {
            kinds: all_kinds,
            events,
            told,
            grads: HashMap::default(),
            states_per_param: 0,
            optimizer_seen,
            training: trains,
            forward_only: false,
            state_like: false,
            in_place: HashMap::default(),
        };
        roles.grads = roles.most_gradients(before, scan, &mut grad_allocs, end);
        roles.states_per_param = roles.states_from(end);
        roles.forward_only = roles.grads.is_empty()
            && !backward_work
            && !roles.optimizer_seen
            && walked.forward_work;
        roles.state_like = roles.forward_only
            && in_threes(
                end.iter()
                    .filter(|l| matches!(roles.told(l), Told::BySize { survives: true })),
            );
        if trains {
            roles.in_place = in_place(&roles, end, &pass_results);
        }
        roles
    }

    /// The most gradients of each size alive at once: the blocks from before
    /// the trace, then the trace's own (`grad_allocs`) as they come and go;
    /// without a trace, the blocks alive now.
    fn most_gradients(
        &self,
        before: &[Live],
        scan: &TraceScan,
        grad_allocs: &mut Vec<(u32, u32, u64)>,
        end: &[Live],
    ) -> HashMap<u64, u32, FastState> {
        let is_grad = |t: Told| matches!(t, Told::Known(Role::Gradients, _));
        let mut live: HashMap<u64, u32, FastState> = HashMap::default();
        for l in before {
            if is_grad(self.untraced(l)) {
                *live.entry(l.requested).or_default() += 1;
            }
        }
        for &(freed, l) in &scan.orphans {
            if is_grad(self.untraced(&l)) {
                *live.entry(l.requested).or_default() += 1;
                grad_allocs.push((NEVER, freed as u32, l.requested));
            }
        }
        let mut most = live.clone();
        // Their starts and ends in trace order; an end sorts before a start
        // at the same entry (an allocation over a held address ends the old one).
        let mut changes: Vec<(u32, bool, u64)> = grad_allocs
            .iter()
            .flat_map(|&(a, f, size)| {
                // A gradient from before the trace (a == NEVER) is counted
                // alive from the start; only its end is a change.
                let start = (a != NEVER).then_some((a, true, size));
                let end = (f != NEVER).then_some((f, false, size));
                start.into_iter().chain(end)
            })
            .collect();
        changes.sort_unstable_by_key(|&(i, start, _)| (i, start));
        for (_, start, size) in changes {
            let n = live.entry(size).or_default();
            if start {
                *n += 1;
                let m = most.entry(size).or_default();
                *m = (*m).max(*n);
            } else {
                *n = n.saturating_sub(1);
            }
        }
        // Without a trace the blocks alive now are all there is.
        if self.events.is_empty() {
            most.clear();
            for l in end {
                if is_grad(self.told(l)) {
                    *most.entry(l.requested).or_default() += 1;
                }
            }
        }
        most
    }

    /// The role of the trace's allocation at entry `i`, as a chart draws it:
    /// one matched by size counts as unknown.
    pub(crate) fn traced_role(&self, i: usize) -> Role {
        match unpack(self.told[i]) {
            Told::Known(r, _) => r,
            _ => Role::Unknown,
        }
    }

    /// What a block's own evidence says, before the size match.
    fn told(&self, l: &Live) -> Told {
        if (l.at as usize) < self.events.len() {
            unpack(self.told[l.at as usize])
        } else {
            self.untraced(l)
        }
    }

    /// A block the trace did not allocate: its frames alone (from the
    /// segments' blocks), or the size match.
    fn untraced(&self, l: &Live) -> Told {
        if l.private_pool {
            return Told::Known(Role::Other, Evidence::Frames);
        }
        // A block from before the trace that the trace frees: the code that
        // freed it says what it was.
        let freed_by = l
            .freeing_entry()
            .and_then(|f| self.events.get(f))
            .map_or(FreedBy::Other, |e| self.kinds.freed_by[e.stack.0 as usize]);
        match freed_by {
            FreedBy::ZeroGrad => return Told::Known(Role::Gradients, Evidence::Frames),
            FreedBy::Optimizer => return Told::Known(Role::OptimizerState, Evidence::Frames),
            FreedBy::Other => {}
        }
        match self.kinds.of[l.stack.0 as usize] {
            Kind::Gradient => Told::Known(Role::Gradients, Evidence::Frames),
            Kind::Library => Told::Known(Role::Other, Evidence::Frames),
            Kind::Input => Told::Known(Role::Inputs, Evidence::Frames),
            Kind::Parameter => Told::Known(Role::Parameters, Evidence::Frames),
            // Alive outside any step it could be a temporary of.
            Kind::Optimizer => Told::Known(Role::OptimizerState, Evidence::Frames),
            Kind::Backward => Told::Unknown(UnknownReason::Backward),
            Kind::Forward if self.training => Told::Known(Role::Activations, Evidence::Frames),
            Kind::Forward => Told::Unknown(UnknownReason::NoBackward),
            Kind::Bare => Told::BySize {
                survives: l.freeing_entry().is_none(),
            },
        }
    }

    /// How many state tensors per parameter the blocks alive at the end
    /// show: for each gradient size, the blocks beyond the parameters'
    /// (matched by size) and the optimizer's own (told by frames), per
    /// gradient; the value that covers the most bytes wins.
    fn states_from(&self, end: &[Live]) -> u32 {
        let mut by_size: HashMap<u64, (u32, u32, u32), FastState> = HashMap::default();
        for l in end {
            let t = self.told(l);
            let slot = by_size.entry(l.requested).or_default();
            match t {
                Told::Known(Role::OptimizerState, _) => slot.0 += 1,
                Told::Known(Role::Parameters, _) => slot.1 += 1,
                Told::BySize { .. } => slot.2 += 1,
                _ => {}
            }
        }
        let mut weight = [0u128; MAX_STATES_PER_PARAM as usize + 1];
        for (requested, (state, params, sized)) in by_size {
            let Some(&g) = self.grads.get(&requested).filter(|&&g| g > 0) else {
                continue;
            };
            let as_params = sized.min(g.saturating_sub(params));
            let extra = state + sized - as_params;
            let k = (extra / g).min(MAX_STATES_PER_PARAM);
            weight[k as usize] += requested as u128 * g as u128;
        }
        (0..=MAX_STATES_PER_PARAM)
            .max_by_key(|&k| (weight[k as usize], std::cmp::Reverse(k)))
            .unwrap_or(0)
    }

    /// Counts the roles of the blocks live at one moment.
    pub(crate) fn at(&self, live: impl Iterator<Item = Live>) -> Moment {
        let mut m = Moment {
            roles: RolesAt::default(),
            unknown: UnknownReason::ALL.map(|w| (w, 0)),
        };
        self.each(live, |_, l, told| match told {
            Ok((r, e)) => m.roles.add(r, l.size, Some(e)),
            Err(w) => {
                m.roles.add(Role::Unknown, l.size, None);
                m.unknown[w as usize].1 += l.size;
            }
        });
        m
    }

    /// Calls `visit` with each block live at one moment (its position in
    /// `live`, the block, and its role with the evidence or why it has
    /// none). The blocks left to the size match come last.
    ///
    /// Of the frameless blocks of one size, the parameters are taken from
    /// those that outlive the trace, and the optimizer state then from the
    /// rest, those the trace frees last first: so a block keeps its role
    /// at every moment it is alive, and a timeline drawn from the roles at
    /// its start agrees with the roles counted at any later moment.
    pub(crate) fn each(
        &self,
        live: impl Iterator<Item = Live>,
        mut visit: impl FnMut(usize, &Live, Result<(Role, Evidence), UnknownReason>),
    ) {
        // Per requested size: the blocks left to the size match and the
        // parameters already told by frames.
        #[derive(Default)]
        struct Pool {
            survives: Vec<(usize, Live)>,
            freed: Vec<(usize, Live)>,
            framed_params: u32,
            framed_state: u32,
        }
        let mut pool: HashMap<u64, Pool, FastState> = HashMap::default();
        for (k, l) in live.enumerate() {
            match self.told(&l) {
                Told::Known(r, e) => {
                    visit(k, &l, Ok((r, e)));
                    match r {
                        Role::Parameters => pool.entry(l.requested).or_default().framed_params += 1,
                        Role::OptimizerState => {
                            pool.entry(l.requested).or_default().framed_state += 1
                        }
                        _ => {}
                    }
                }
                Told::BySize { survives: true } => {
                    pool.entry(l.requested).or_default().survives.push((k, l))
                }
                Told::BySize { survives: false } => {
                    pool.entry(l.requested).or_default().freed.push((k, l))
                }
                Told::Unknown(w) => visit(k, &l, Err(w)),
            }
        }
        let mut pool: Vec<_> = pool.into_iter().collect();
        // The same moment visits in the same order whatever the hash order.
        pool.sort_unstable_by_key(|&(requested, _)| requested);
        for (requested, p) in pool {
            let g = self.grads.get(&requested).copied().unwrap_or(0) as usize;
            if self.forward_only {
                // No gradient to match: the model is what outlives forward.
                for (k, l) in &p.survives {
                    let told = if self.state_like {
                        Err(UnknownReason::ParamsOrState)
                    } else {
                        Ok((Role::Parameters, Evidence::Lifetimes))
                    };
                    visit(*k, l, told);
                }
                for (k, l) in &p.freed {
                    visit(*k, l, Err(UnknownReason::NoEvidence));
                }
                continue;
            }
            // A gradient from before the trace, accumulated in place, comes
            // in a pair with its parameter among the blocks that outlive it.
            let before = self.in_place.get(&requested).copied().unwrap_or(0) as usize;
            // The trace's gradients of that size were results added into them.
            let g = if before > 0 { 0 } else { g };
            // A parameter outlives the trace; one per gradient of its size.
            let params = p
                .survives
                .len()
                .min((g + before).saturating_sub(p.framed_params as usize));
            let old_grads = (p.survives.len() - params).min(before);
            // Up to k states per gradient, less those other evidence told.
            let state = if self.optimizer_seen {
                (self.states_per_param as usize * g).saturating_sub(p.framed_state as usize)
            } else {
                0
            };
            for (k, l) in &p.survives[..params] {
                visit(*k, l, Ok((Role::Parameters, Evidence::Sizes)));
            }
            for (k, l) in &p.survives[params..params + old_grads] {
                visit(*k, l, Ok((Role::Gradients, Evidence::Sizes)));
            }
            // Live sets list the blocks the trace frees in the order it
            // frees them: the last freed is the longest kept.
            let rest = p.survives[params + old_grads..]
                .iter()
                .chain(p.freed.iter().rev());
            for (n, (k, l)) in rest.enumerate() {
                let told = if n < state {
                    Ok((Role::OptimizerState, Evidence::Sizes))
                } else {
                    Err(UnknownReason::NoEvidence)
                };
                visit(*k, l, told);
            }
        }
    }
}

/// Per size, how many parameters keep a gradient from before the trace: a
/// run recorded after its first backward accumulates into gradients it
/// allocated earlier, so no entry tells them. The frameless blocks that
/// outlive such a trace are parameters and gradients in pairs (at least
/// twice as many as the gradients the trace saw alive at once, and none of
/// the trace's own gradients alive at its end, which would make them
/// parameters alone), and something else must say how many parameters
/// have that size: the optimizer state alive at the end (at least one
/// tensor per parameter), or the results one backward pass computed and
/// freed (one per parameter, added into its gradient; the trace's
/// short-lived "gradients" of that size were such results too).
fn in_place(
    roles: &DeviceRoles,
    end: &[Live],
    pass_results: &HashMap<u64, u32, FastState>,
) -> HashMap<u64, u32, FastState> {
    // Per size: frameless blocks alive from before the trace, the trace's
    // gradients alive now, and optimizer state alive now.
    let mut by_size: HashMap<u64, (u32, u32, u32), FastState> = HashMap::default();
    for l in end {
        let slot = by_size.entry(l.requested).or_default();
        match roles.told(l) {
            Told::BySize { survives: true } if l.at == Live::UNTRACED => slot.0 += 1,
            Told::Known(Role::Gradients, _) => slot.1 += 1,
            Told::Known(Role::OptimizerState, Evidence::Frames | Evidence::Lifetimes) => {
                slot.2 += 1
            }
            _ => {}
        }
    }
    by_size
        .into_iter()
        .filter_map(|(size, (untraced, grads_now, state))| {
            let seen = roles.grads.get(&size).copied().unwrap_or(0);
            if grads_now > 0 || untraced < 2 * seen.max(1) {
                return None;
            }
            // A result freed just after its pass ended was told a gradient
            // by its lifetime: here it was one more result added in place.
            let results = pass_results.get(&size).copied().unwrap_or(0) + seen;
            let params = results.max(state);
            let pairs = (untraced / 2).min(params);
            (pairs > 0).then_some((size, pairs))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame_kinds::kinds;
    use crate::stacks::{Frame, Stacks};

    fn frame(filename: &str, name: &str) -> Frame {
        Frame {
            filename: filename.into(),
            line: 1,
            name: name.into(),
        }
    }

    /// A snapshot in miniature: stacks by kind, a trace, and the blocks
    /// from before it (address, block size, requested size), all alive at
    /// the end.
    struct Mini {
        stacks: Stacks,
        events: Vec<TraceEvent>,
        before: Vec<(u64, u64, u64)>,
    }

    const FORWARD: &[(&str, &str)] = &[("/home/me/model.py", "forward")];
    const BACKWARD: &[(&str, &str)] = &[
        ("Functions.cpp", "torch::autograd::generated::MulBackward0_apply_functional(std::vector<at::Tensor>)"),
        ("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
    ];
    const GRAD: &[(&str, &str)] = &[
        ("accumulate_grad.cpp", "torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)"),
        ("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
    ];
    const OPTIM: &[(&str, &str)] = &[(
        "/venv/site-packages/torch/optim/adamw.py",
        "_multi_tensor_adamw",
    )];

    impl Mini {
        fn new() -> Self {
            Mini {
                stacks: Stacks::default(),
                events: Vec::new(),
                before: Vec::new(),
            }
        }

        fn push(&mut self, action: Action, addr: u64, size: u64, frames: &[(&str, &str)]) -> usize {
            let ids: Vec<_> = frames
                .iter()
                .map(|(p, n)| self.stacks.intern_frame(frame(p, n)))
                .collect();
            let mut e = TraceEvent::BLANK;
            e.action = action;
            e.addr = addr;
            e.size = size;
            e.stack = self.stacks.intern_stack(ids);
            self.events.push(e);
            self.events.len() - 1
        }

        fn alloc(&mut self, addr: u64, size: u64, frames: &[(&str, &str)]) -> usize {
            self.push(Action::Alloc, addr, size, frames)
        }

        fn free(&mut self, addr: u64, size: u64) -> usize {
            self.push(Action::FreeCompleted, addr, size, &[])
        }

        /// The roles after entry `i` (`None`: at the end), in MiB-free bytes.
        fn roles(&self, i: Option<usize>) -> Moment {
            let kinds = kinds(&self.stacks);
            let scan = crate::replay::scan_trace(&self.events);
            let before: Vec<Live> = self
                .before
                .iter()
                .map(|&(_, size, requested)| Live {
                    size,
                    requested,
                    stack: StackId::EMPTY,
                    before_recording: true,
                    private_pool: false,
                    at: Live::UNTRACED,
                })
                .collect();
            let mut end = before.clone();
            for &a in scan.open.values() {
                let e = &self.events[a as usize];
                end.push(Live {
                    size: e.size,
                    requested: e.size,
                    stack: e.stack,
                    before_recording: false,
                    private_pool: false,
                    at: a,
                });
            }
            let roles = DeviceRoles::new(
                &kinds,
                &self.events,
                &scan,
                &Context::default(),
                &before,
                &end,
            );
            match i {
                None => roles.at(end.into_iter()),
                Some(i) => {
                    let mut out = None;
                    crate::replay::live_at(&self.events, &scan, &before, &[i], |_, live| {
                        out = Some(roles.at(live))
                    });
                    out.unwrap()
                }
            }
        }
    }

    /// A training step recorded after the model and two Adam states per
    /// parameter were made: forward, backward, an optimizer step.
    fn training_step() -> (Mini, usize) {
        let mut m = Mini::new();
        // Parameters of 1000 and 2000 bytes (blocks rounded up), each with
        // two state tensors, all from before recording.
        for (k, (size, req)) in [(1024, 1000), (2048, 2000)].into_iter().enumerate() {
            for copy in 0..3 {
                m.before.push((1000 + 10 * k as u64 + copy, size, req));
            }
        }
        m.alloc(10, 500, FORWARD); // activation: freed in backward
        m.alloc(11, 300, FORWARD); // temporary: freed before backward
        m.free(11, 300);
        m.alloc(12, 400, BACKWARD); // backward temporary
        m.free(12, 400);
        m.free(10, 500);
        let peak = m.alloc(13, 1000, GRAD); // a gradient by its frames
        m.alloc(14, 2000, BACKWARD); // a gradient taken over from a backward node
        m.alloc(15, 100, OPTIM); // the optimizer's temporary
        m.free(15, 100);
        (m, peak)
    }

    #[test]
    fn a_training_step_tells_every_role() {
        let (m, _) = training_step();
        let end = m.roles(None).roles;
        assert_eq!(end.bytes.gradients, 3000);
        assert_eq!(end.evidence.gradients.frames, 1000);
        assert_eq!(end.evidence.gradients.lifetimes, 2000);
        // One block of each size is the parameter; two per gradient are state.
        assert_eq!(end.bytes.parameters, 1024 + 2048);
        assert_eq!(end.evidence.parameters.sizes, 1024 + 2048);
        // The optimizer ran (its temporary shows it), so two per gradient are its state.
        assert_eq!(end.bytes.optimizer_state, 2 * (1024 + 2048));
        assert_eq!(end.evidence.optimizer_state.sizes, 2 * (1024 + 2048));
        assert_eq!(end.bytes.unknown, 0);
        assert_eq!(end.bytes.total(), 3000 + 3 * (1024 + 2048));

        // Just after the activation's backward began: the forward tensor
        // alive then is an activation; the backward's own was a temporary.
        let (m, _) = training_step();
        let at = m.roles(Some(3)).roles;
        assert_eq!(at.bytes.activations, 500);
        assert_eq!(at.bytes.temporaries, 400);
        let at = m.roles(Some(1)).roles;
        assert_eq!((at.bytes.activations, at.bytes.temporaries), (500, 300));
        assert_eq!(at.bytes.total(), 500 + 300 + 3 * (1024 + 2048));
    }

    #[test]
    fn gradients_from_before_the_trace_pair_with_their_parameters() {
        // Recorded after the first backward: a parameter and its gradient
        // of each size from before, and a backward whose results (one per
        // parameter) are added into the gradients and freed.
        let mut m = Mini::new();
        for (k, (size, req)) in [(1024, 1000), (2048, 2000)].into_iter().enumerate() {
            for copy in 0..2 {
                m.before.push((1000 + 10 * k as u64 + copy, size, req));
            }
        }
        m.alloc(10, 500, FORWARD);
        m.alloc(12, 1000, BACKWARD);
        m.free(12, 1000);
        // The pass's last result, freed after it: its lifetime alone says gradient.
        m.alloc(14, 2000, BACKWARD);
        m.free(10, 500);
        m.free(14, 2000);
        m.alloc(20, 500, FORWARD); // the next step
        let end = m.roles(None).roles;
        assert_eq!(end.bytes.parameters, 1024 + 2048);
        assert_eq!(end.bytes.gradients, 1024 + 2048);
        assert_eq!(end.evidence.gradients.sizes, 1024 + 2048);
        // The next step's forward in progress.
        assert_eq!((end.bytes.activations, end.bytes.unknown), (500, 0));

        // Gradients the trace allocates and frees (zero_grad with
        // set_to_none): the blocks from before are the parameters alone.
        let mut m = Mini::new();
        m.before.push((1000, 1024, 1000));
        m.before.push((1010, 2048, 2000));
        m.alloc(10, 500, FORWARD);
        m.alloc(13, 1000, GRAD);
        m.alloc(14, 2000, GRAD);
        m.free(10, 500);
        m.free(13, 1000);
        m.free(14, 2000);
        let end = m.roles(None).roles;
        assert_eq!(end.bytes.parameters, 1024 + 2048);
        assert_eq!(end.bytes.gradients, 0);
    }

    /// An optimizer that replaces each weight (`p.data = p.data - lr * p.grad`,
    /// as hand-written SGD loops do): the new weight is made in its step and
    /// the old one of the same size freed after it; the new one is the
    /// parameter, step after step, and Adam-like state stays state.
    #[test]
    fn a_weight_the_step_puts_in_place_of_another_is_a_parameter() {
        const BUILT: &[(&str, &str)] =
            &[("/venv/site-packages/torch/nn/modules/linear.py", "__init__")];
        let mut m = Mini::new();
        m.alloc(1, 4096, BUILT);
        for (step, (old, new)) in [(1u64, 2u64), (2, 3)].into_iter().enumerate() {
            let act = 100 + step as u64;
            m.alloc(act, 512, FORWARD);
            m.alloc(200 + act, 4096, GRAD);
            m.free(act, 512);
            m.alloc(new, 4096, OPTIM);
            m.push(Action::FreeCompleted, old, 4096, OPTIM);
            m.free(200 + act, 4096);
        }
        // An optimizer's state: made in the step, kept, nothing of its size freed.
        m.alloc(50, 8192, OPTIM);
        m.alloc(300, 512, FORWARD); // the next step
        let end = m.roles(None).roles;
        assert_eq!(end.bytes.parameters, 4096);
        assert_eq!(end.bytes.optimizer_state, 8192);
        // Between the two steps the first replacement is the parameter too.
        let at = m.roles(Some(8)).roles;
        assert_eq!(at.bytes.parameters, 4096, "{:?}", at.bytes);
    }

    #[test]
    fn without_an_optimizer_the_extra_copies_stay_unknown() {
        let mut m = Mini::new();
        for (k, (size, req)) in [(1024, 1000), (2048, 2000)].into_iter().enumerate() {
            for copy in 0..3 {
                m.before.push((1000 + 10 * k as u64 + copy, size, req));
            }
        }
        m.alloc(10, 500, FORWARD);
        m.alloc(13, 1000, GRAD);
        m.alloc(14, 2000, GRAD);
        let end = m.roles(None);
        assert_eq!(end.roles.bytes.parameters, 1024 + 2048);
        assert_eq!(end.roles.bytes.optimizer_state, 0);
        assert_eq!(end.roles.bytes.unknown, 2 * (1024 + 2048) + 500);
    }

    #[test]
    fn optimizer_state_from_sizes_stops_at_two_per_parameter_with_those_told_by_frames() {
        let (mut m, _) = training_step();
        // A third extra copy of the 2000-byte parameter: not Adam's.
        m.before.push((2000, 2048, 2000));
        // One state tensor of the 1000-byte parameter made in the trace and
        // kept: told by its frames, it leaves one of that size to the sizes.
        m.alloc(16, 1000, OPTIM);
        let end = m.roles(None);
        let r = &end.roles;
        assert_eq!(r.bytes.optimizer_state, 1000 + 1024 + 2 * 2048);
        assert_eq!(r.evidence.optimizer_state.frames, 1000);
        assert_eq!(r.evidence.optimizer_state.sizes, 1024 + 2 * 2048);
        assert_eq!(r.bytes.unknown, 1024 + 2048);
        assert_eq!(end.main_reason(), Some(UnknownReason::NoEvidence));
    }

    #[test]
    fn a_forward_only_trace_tells_parameters_by_their_lifetimes() {
        let mut m = Mini::new();
        m.before.push((1000, 4096, 4000));
        m.before.push((1001, 8192, 8000));
        m.alloc(10, 100, FORWARD);
        m.free(10, 100);
        m.alloc(11, 200, FORWARD); // an output, still held
        let end = m.roles(None);
        assert_eq!(end.roles.bytes.parameters, 4096 + 8192);
        assert_eq!(end.roles.evidence.parameters.lifetimes, 4096 + 8192);
        assert_eq!(
            end.roles.bytes.gradients + end.roles.bytes.optimizer_state,
            0
        );
        assert_eq!(end.roles.bytes.unknown, 200);
        assert_eq!(end.main_reason(), Some(UnknownReason::NoBackward));
        let at = m.roles(Some(0)).roles;
        assert_eq!(at.bytes.temporaries, 100);

        // Three of every size: parameters with Adam's state look the same.
        let mut m = Mini::new();
        for k in 0..3 {
            m.before.push((1000 + k, 4096, 4000));
            m.before.push((2000 + k, 8192, 8000));
        }
        m.alloc(10, 100, FORWARD);
        let end = m.roles(None);
        assert_eq!(end.roles.bytes.parameters, 0);
        assert_eq!(end.main_reason(), Some(UnknownReason::ParamsOrState));
    }

    #[test]
    fn python_only_stacks_put_frameless_allocations_in_backward() {
        let mut m = Mini::new();
        m.before.push((1000, 1024, 1000));
        m.alloc(10, 500, FORWARD);
        m.alloc(12, 400, &[]); // backward temporary, on autograd's thread
        m.free(12, 400);
        m.free(10, 500);
        m.alloc(13, 1000, &[]); // the gradient
        let end = m.roles(None).roles;
        assert_eq!(end.bytes.gradients, 1000);
        assert_eq!(end.bytes.parameters, 1024);
        let at = m.roles(Some(1)).roles;
        assert_eq!((at.bytes.activations, at.bytes.temporaries), (500, 400));
    }

    #[test]
    fn the_code_that_freed_a_block_from_before_the_trace_says_what_it_was() {
        let mut m = Mini::new();
        // A parameter, its gradient and an old state tensor, all from before recording.
        m.before.push((1000, 1024, 1000));
        m.alloc(10, 500, FORWARD);
        let peak = m.alloc(11, 1000, GRAD);
        // The old gradient, freed by zero_grad; the old state, replaced by the step.
        m.push(
            Action::FreeCompleted,
            2000,
            1000,
            &[("/venv/site-packages/torch/optim/optimizer.py", "zero_grad")],
        );
        m.push(Action::FreeCompleted, 3000, 1000, OPTIM);
        let at = m.roles(Some(peak)).roles;
        assert_eq!(at.bytes.gradients, 1000 + 1000);
        assert_eq!(at.evidence.gradients.frames, 2000);
        assert_eq!(at.bytes.optimizer_state, 1000);
        assert_eq!(at.evidence.optimizer_state.frames, 1000);
        assert_eq!(at.bytes.parameters, 1024);
    }

    #[test]
    fn packing_keeps_every_told() {
        for r in Role::ALL {
            for e in [Evidence::Frames, Evidence::Lifetimes, Evidence::Sizes] {
                assert_eq!(unpack(pack(Told::Known(r, e))), Told::Known(r, e));
            }
        }
        for w in UnknownReason::ALL {
            assert_eq!(unpack(pack(Told::Unknown(w))), Told::Unknown(w));
        }
        for survives in [true, false] {
            let t = Told::BySize { survives };
            assert_eq!(unpack(pack(t)), t);
        }
    }
}
