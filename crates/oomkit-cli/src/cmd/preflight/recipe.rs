//! A torchtune recipe's own memory switches as the changes "what would make it fit"
//! measures: each switch its config leaves off, as the override a user adds to
//! `tune run` (`enable_activation_checkpointing=True`), run on the recipe.

use super::{expandable_change, Change, HALF_THE_BATCH_COST};
use oomkit_report::Recipe;
use serde_json::Value;

/// The framework name a torchtune recipe's run gives.
pub(super) const TORCHTUNE: &str = "torchtune";

/// The chunked loss torchtune's recipes take (`loss=...`).
const CHUNKED_LOSS: &str = "torchtune.modules.loss.CEWithChunkedOutputLoss";

/// The 8-bit optimizer torchtune's single-device configs use (`optimizer=...`).
const EIGHT_BIT_OPTIMIZER: &str = "bitsandbytes.optim.PagedAdamW8bit";

/// Arguments of PyTorch's AdamW that bitsandbytes' optimizers do not take: removed
/// (`~optimizer.fused`) where the recipe's optimizer is given them.
const NOT_FOR_BITSANDBYTES: [&str; 5] = [
    "fused",
    "foreach",
    "capturable",
    "differentiable",
    "maximize",
];

/// A switch of the recipe's that is true or false, with what turning it on costs.
struct Switch {
    /// Its key in the config.
    key: &'static str,
    /// What it costs, in words.
    cost: &'static str,
    /// It steps each parameter from its gradient hook: one backward per optimizer step.
    one_backward: bool,
}

/// The recipe's switches, in the order of torchtune's own memory table.
const SWITCHES: [Switch; 4] = [
    Switch {
        key: "compile",
        cost: "a compilation before the first step (minutes for a large model), then usually faster steps",
        one_backward: false,
    },
    Switch {
        key: "enable_activation_checkpointing",
        cost: "each layer's forward run again in backward (about a third more compute)",
        one_backward: false,
    },
    Switch {
        key: "optimizer_in_bwd",
        cost: "each parameter stepped as its gradient is ready: no gradient accumulation or clipping",
        one_backward: true,
    },
    Switch {
        key: "enable_activation_offloading",
        cost: "activations copied to pinned host memory and back, overlapped on a second stream",
        one_backward: false,
    },
];

/// The changes to a torchtune recipe, each the overrides a user would add; one its config
/// already makes says so (`already`). What cannot be tried is a note.
pub(super) fn changes(recipe: &Recipe, command: &[String], notes: &mut Vec<String>) -> Vec<Change> {
    let settings = &recipe.settings;
    let flag = |key: &str| settings.get(key).and_then(Value::as_bool).unwrap_or(false);
    let text = |key: &str| settings.get(key).and_then(Value::as_str).unwrap_or("");
    let number = |key: &str| settings.get(key).and_then(Value::as_u64);
    let accumulation = number("gradient_accumulation_steps").unwrap_or(1);
    let mut out = Vec::new();
    for s in &SWITCHES {
        if s.one_backward && accumulation > 1 && !flag(s.key) {
            notes.push(format!(
                "{}=True: not measured: it takes gradient_accumulation_steps=1, and the recipe accumulates {accumulation}",
                s.key
            ));
            continue;
        }
        out.push(Change {
            change: format!("{}=True", s.key),
            cost: s.cost,
            args: vec![format!("{}=True", s.key)],
            already: flag(s.key).then(|| format!("the recipe sets {}=True already", s.key)),
            one_backward: s.one_backward,
            ..Change::default()
        });
    }
    let loss = text("loss._component_");
    out.push(Change {
        change: format!("loss={CHUNKED_LOSS}"),
        cost: "none to speak of: the output projection and the loss computed in chunks",
        args: vec![format!("loss={CHUNKED_LOSS}")],
        already: loss
            .ends_with("CEWithChunkedOutputLoss")
            .then(|| "the recipe's loss is chunked already".to_string()),
        ..Change::default()
    });
    let optimizer = text("optimizer._component_");
    let names = |key: &str| -> Vec<String> {
        let given = settings.get(key).and_then(Value::as_array);
        given
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|k| NOT_FOR_BITSANDBYTES.contains(k))
            .map(str::to_string)
            .collect()
    };
    // An argument the config file gives is removed with `~`; one the command line gives
    // (`optimizer.fused=True`) is taken off the command.
    let mut args = vec![format!("optimizer={EIGHT_BIT_OPTIMIZER}")];
    args.extend(
        names("optimizer_args_in_file")
            .iter()
            .map(|k| format!("~optimizer.{k}")),
    );
    let drop: Vec<String> = names("optimizer_args")
        .iter()
        .map(|k| format!("optimizer.{k}="))
        .filter(|d| command.iter().any(|w| w.starts_with(d.as_str())))
        .collect();
    let mut change = args.join(" ");
    if !drop.is_empty() {
        // Said, since the row's words alone would not be the command it ran.
        let taken: Vec<&str> = drop.iter().map(|d| d.trim_end_matches('=')).collect();
        change = format!("{change} ({} off the command)", taken.join(", "));
    }
    out.push(Change {
        change,
        cost: "the optimizer's moments in 8 bits, paged to the host when the GPU is short (bitsandbytes installed)",
        args,
        drop,
        already: optimizer
            .contains("8bit")
            .then(|| format!("the recipe's optimizer is 8-bit already ({optimizer})")),
        ..Change::default()
    });
    out.push(expandable_change());
    match number("batch_size") {
        Some(b) if b > 1 && !flag("optimizer_in_bwd") => {
            let half = format!("batch_size={}", b / 2);
            let more = format!("gradient_accumulation_steps={}", 2 * accumulation);
            out.push(Change {
                change: format!("{half} {more}"),
                cost: HALF_THE_BATCH_COST,
                args: vec![half, more],
                accumulates: true,
                ..Change::default()
            });
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn recipe(settings: Value) -> Recipe {
        let settings: BTreeMap<String, Value> = serde_json::from_value(settings).unwrap();
        Recipe {
            framework: TORCHTUNE.into(),
            name: "FullFinetuneRecipeSingleDevice".into(),
            settings,
        }
    }

    #[test]
    fn switches_off_are_changes_and_those_on_say_so() {
        let r = recipe(serde_json::json!({
            "compile": false, "enable_activation_checkpointing": true, "optimizer_in_bwd": false,
            "enable_activation_offloading": false, "loss._component_": "torch.nn.CrossEntropyLoss",
            "optimizer._component_": "torch.optim.AdamW", "optimizer_args": ["fused", "lr"],
            "optimizer_args_in_file": ["fused", "lr"],
            "batch_size": 4, "gradient_accumulation_steps": 1,
        }));
        let mut notes = Vec::new();
        let command = [
            "tune".to_string(),
            "run".into(),
            "optimizer.fused=True".into(),
        ];
        let found = changes(&r, &command, &mut notes);
        let words: Vec<&str> = found.iter().map(|c| c.change.as_str()).collect();
        assert_eq!(
            words,
            [
                "compile=True",
                "enable_activation_checkpointing=True",
                "optimizer_in_bwd=True",
                "enable_activation_offloading=True",
                "loss=torchtune.modules.loss.CEWithChunkedOutputLoss",
                "optimizer=bitsandbytes.optim.PagedAdamW8bit ~optimizer.fused (optimizer.fused off the command)",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                "batch_size=2 gradient_accumulation_steps=2",
            ]
        );
        let already: Vec<bool> = found.iter().map(|c| c.already.is_some()).collect();
        assert_eq!(
            already,
            [false, true, false, false, false, false, false, false]
        );
        assert!(notes.is_empty());
    }

    #[test]
    fn the_step_in_backward_is_not_tried_with_accumulation_nor_halving_with_it() {
        let accumulating =
            recipe(serde_json::json!({"gradient_accumulation_steps": 8, "batch_size": 4}));
        let mut notes = Vec::new();
        let found = changes(&accumulating, &[], &mut notes);
        assert!(found
            .iter()
            .all(|c| !c.change.starts_with("optimizer_in_bwd")));
        assert!(notes[0].contains("recipe accumulates 8"), "{notes:?}");
        assert!(found
            .iter()
            .any(|c| c.change == "batch_size=2 gradient_accumulation_steps=16"));

        let in_backward = recipe(serde_json::json!({"optimizer_in_bwd": true, "batch_size": 4}));
        let found = changes(&in_backward, &[], &mut Vec::new());
        assert!(found.iter().all(|c| !c.accumulates));
    }
}
