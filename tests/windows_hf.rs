//! Each layer's sliding window from config.json (`HfConfig::sliding_window`), as transformers
//! builds the layer for each model family: the window of the layers that slide, `None` for the
//! others. No GPU.

use rope_cuda::{ConfigError, Error, HfConfig};

fn windows(json: &str, layers: usize) -> Vec<Option<usize>> {
    let model = HfConfig::parse(json).unwrap();
    (0..layers).map(|l| model.sliding_window(l).unwrap()).collect()
}

fn data(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/data/configs/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn each_family_slides_the_layers_transformers_slides() {
    let (s, f) = (Some, None::<usize>);
    // gpt-oss: its config types every layer; sliding ones of 128.
    let gpt_oss = r#"{"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}"#;
    assert_eq!(windows(gpt_oss, 4), [s(128), f, s(128), f]);
    // Gemma 3 without layer_types: every sixth layer full (sliding_window_pattern 6).
    let gemma3 = r#"{"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024}"#;
    let want: Vec<_> = (0..12).map(|l| if (l + 1) % 6 == 0 { f } else { s(1024) }).collect();
    assert_eq!(windows(gemma3, 12), want);
    // Cohere 2: every fourth layer full.
    let cohere2 = r#"{"model_type": "cohere2", "num_hidden_layers": 8, "sliding_window": 4096}"#;
    assert_eq!(windows(cohere2, 8), [s(4096), s(4096), s(4096), f, s(4096), s(4096), s(4096), f]);
    // Gemma 2 without layer_types: even layers slide (transformers' Gemma2Config default).
    let gemma2 = r#"{"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096}"#;
    assert_eq!(windows(gemma2, 4), [s(4096), f, s(4096), f]);
    // Mistral and Phi-3: every layer.
    let mistral = r#"{"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096}"#;
    assert_eq!(windows(mistral, 3), [s(4096); 3]);
    // Phi-3 mini 128k's config: "sliding_window": 262144.
    let phi3 = r#"{"model_type": "phi3", "num_hidden_layers": 2, "sliding_window": 262144}"#;
    assert_eq!(windows(phi3, 2), [s(262144); 2]);
    // Mistral with a null window, Llama 3.1 without one: none.
    let unbounded = r#"{"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": null}"#;
    assert_eq!(windows(unbounded, 2), [f, f]);
    assert_eq!(HfConfig::parse(&data("llama-3.1-8b.json")).unwrap().sliding_window(0).unwrap(), None);
    // Qwen2.5 7B's config: a window given, use_sliding_window false: none.
    let qwen25 = r#"{"model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 131072,
        "use_sliding_window": false, "max_window_layers": 28}"#;
    assert_eq!(windows(qwen25, 28), [f; 28]);
    // Qwen2 with use_sliding_window: the layers from max_window_layers on.
    let qwen2 = r#"{"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 32768,
        "use_sliding_window": true, "max_window_layers": 2}"#;
    assert_eq!(windows(qwen2, 4), [f, f, s(32768), s(32768)]);
}

#[test]
fn a_layer_past_the_model_or_a_bad_window_is_a_typed_error() {
    let mistral = HfConfig::parse(r#"{"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}"#).unwrap();
    assert!(matches!(mistral.sliding_window(2), Err(Error::Config(ConfigError::NoSuchLayer { layer: 2, layers: 2 }))));
    for bad in [
        r#"{"model_type": "mistral", "sliding_window": 0}"#,
        r#"{"model_type": "mistral", "sliding_window": "wide"}"#,
        r#"{"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": "yes"}"#,
    ] {
        let model = HfConfig::parse(bad).unwrap();
        assert!(matches!(model.sliding_window(0), Err(Error::Config(ConfigError::Invalid { .. }))), "{bad}");
    }
}
