//! Model prices, for budgets in US dollars (docs/concepts.md, "Budgets").
//! The operator gives each model a price per million tokens, one for the
//! prompt and one for the answer (`serve --model-price
//! gpt-4o-mini=0.15/0.60`). A priced `model.chat` call records what it
//! cost in its result (`cost_usd_nanos`), at the price of the moment, so a
//! tree's spend is a sum over committed rows that a later price change or
//! a replay never moves.

use std::collections::BTreeMap;

use serde_json::Value;

/// Nano-dollars in one dollar: costs and budgets are kept as whole
/// nano-dollars, so sums are exact.
pub const NANOS_PER_USD: f64 = 1e9;

/// A model's price, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    /// Per million prompt (input) tokens.
    pub prompt: f64,
    /// Per million answer (output) tokens.
    pub answer: f64,
}

impl Price {
    /// What `prompt` and `answer` tokens cost, in nano-dollars, rounded up.
    pub fn cost_nanos(&self, prompt: i64, answer: i64) -> i64 {
        // $ per million tokens is 1,000 nano-dollars per token.
        let nanos = (prompt.max(0) as f64 * self.prompt + answer.max(0) as f64 * self.answer) * 1e3;
        nanos.ceil().min(i64::MAX as f64) as i64
    }
}

/// Prices by model name (exact names: the name a request asks for).
/// Default: none, so no model is priced and a budget in dollars denies
/// every `model.chat` under it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prices(BTreeMap<String, Price>);

impl Prices {
    /// Parses `MODEL=PROMPT/ANSWER` entries (dollars per million tokens);
    /// a later entry for a model replaces an earlier one.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Prices, String> {
        let mut prices = BTreeMap::new();
        for entry in entries.iter().map(|e| e.as_ref().trim()).filter(|e| !e.is_empty()) {
            let bad = |why: &str| format!("model price {entry:?}: {why} (expected MODEL=PROMPT/ANSWER in dollars per million tokens, e.g. gpt-4o-mini=0.15/0.60)");
            let (model, price) = entry.rsplit_once('=').ok_or_else(|| bad("no `=`"))?;
            let (prompt, answer) = price.split_once('/').ok_or_else(|| bad("no `/` between the two prices"))?;
            let number = |s: &str| match s.trim().parse::<f64>() {
                Ok(p) if p.is_finite() && (0.0..=1e6).contains(&p) => Ok(p),
                _ => Err(bad(&format!("{s:?} is not a price from 0 to 1000000"))),
            };
            let model = model.trim();
            if model.is_empty() {
                return Err(bad("no model name"));
            }
            prices.insert(model.to_string(), Price { prompt: number(prompt)?, answer: number(answer)? });
        }
        Ok(Prices(prices))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The price of `model`, if it has one.
    pub fn get(&self, model: &str) -> Option<Price> {
        self.0.get(model).copied()
    }

    /// The most a call to `model` may cost before it goes out, in
    /// nano-dollars: its prompt and answer tokens at the model's price.
    /// `None`: unpriced.
    pub fn estimate(&self, model: &str, (prompt, answer): (i64, i64)) -> Option<i64> {
        Some(self.get(model)?.cost_nanos(prompt, answer))
    }
}

/// What a finished call cost, in nano-dollars, from the `usage` its answer
/// reported: `prompt_tokens` and `completion_tokens` at their prices, or
/// `total_tokens` all at the answer's price (the dearer, as a rule) when
/// the two are not given. Without usage, the estimate it held is charged.
pub fn cost_nanos(price: Price, usage: Option<&Value>, estimate: (i64, i64)) -> i64 {
    let field = |k: &str| usage.and_then(|u| u.get(k)).and_then(Value::as_i64);
    match (field("prompt_tokens"), field("completion_tokens"), field("total_tokens")) {
        (Some(p), Some(c), _) => price.cost_nanos(p, c),
        (_, _, Some(t)) => price.cost_nanos(0, t),
        _ => price.cost_nanos(estimate.0, estimate.1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prices_parse_from_model_equals_prompt_slash_answer() {
        let p = Prices::parse(&["gpt-4o-mini=0.15/0.60", " local/llama:8b = 0/0 "]).unwrap();
        assert_eq!(p.get("gpt-4o-mini"), Some(Price { prompt: 0.15, answer: 0.60 }));
        assert_eq!(p.get("local/llama:8b"), Some(Price { prompt: 0.0, answer: 0.0 }), "a name may hold `/` and `:`");
        assert_eq!(p.get("gpt-4o"), None);
        for bad in ["gpt", "gpt=1", "=1/2", "gpt=a/2", "gpt=-1/2", "gpt=1/inf", "gpt=1/NaN"] {
            assert!(Prices::parse(&[bad]).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn a_cost_is_whole_nano_dollars_from_the_reported_usage() {
        let price = Price { prompt: 0.15, answer: 0.60 };
        // 1,000 prompt tokens at $0.15/M = $0.00015; 500 at $0.60/M = $0.0003.
        let usage = json!({ "prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500 });
        assert_eq!(cost_nanos(price, Some(&usage), (0, 0)), 450_000);
        assert_eq!(cost_nanos(price, Some(&json!({ "total_tokens": 1500 })), (0, 0)), 900_000, "all at the answer's price");
        assert_eq!(cost_nanos(price, None, (10, 20)), 13_500, "the estimate when nothing is reported");
        assert_eq!(Price { prompt: 1e-9, answer: 0.0 }.cost_nanos(1, 0), 1, "rounded up");
    }
}
