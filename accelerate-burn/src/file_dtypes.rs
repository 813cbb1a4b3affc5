//! How float tensors change dtype on their way to and from a weights file: an export writes
//! them in one dtype ([`ExportDtype`], `export_dtype(BF16)`), and a load gives each the dtype
//! the model's own parameter has ([`ModelDtypes`]), so a bf16 export loads into an f32 model
//! as f32 (and on a backend without bf16 at all). Both are burn-store adapters: the cast is
//! composed onto the tensor's deferred bytes, each value rounded once.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::Module;
use burn::store::burn_pack::Tensor as PackTensor;
use burn::store::{ModuleAdapter, ModuleContext, ModuleSnapshot, bridge};
use burn::tensor::DType;

/// `tensor` cast to `target` (deferred), or unchanged when it is not a float tensor or
/// already `target`.
fn cast_float(tensor: PackTensor, target: DType) -> PackTensor {
    if !tensor.dtype.is_float() || tensor.dtype == target {
        return tensor;
    }
    let (name, shape) = (tensor.name.clone(), tensor.shape.clone());
    bridge::map_data(tensor, name, target, shape, move |data| {
        data.convert_dtype(target)
    })
}

/// `values` as the little-endian bytes of `dtype` in a file: F32 as they are, BF16 and F16
/// each rounded to nearest even once, as [`ExportDtype`] writes them (a model with sharded
/// units, whose gathered parameters are streamed as bytes).
pub(crate) fn f32_bytes_as(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => {
            let mut bytes = Vec::new();
            crate::params::extend_le_bytes(&mut bytes, values);
            bytes
        }
    }
}

/// Writes every float tensor in one dtype; other tensors pass unchanged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExportDtype(pub DType);

impl ModuleAdapter for ExportDtype {
    fn adapt(&self, tensor: PackTensor, _: ModuleContext<'_>) -> PackTensor {
        cast_float(tensor, self.0)
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(*self)
    }
}

/// Reads each float tensor in the dtype the model's parameter of that name has.
#[derive(Debug, Clone)]
pub(crate) struct ModelDtypes(Arc<HashMap<String, DType>>);

impl ModelDtypes {
    /// The dtypes of `model`'s float tensors, by path.
    pub(crate) fn of<M: Module>(model: &M) -> Self {
        let dtypes = model
            .collect(None, None, false)
            .into_iter()
            .filter(|t| t.dtype.is_float())
            .map(|t| (t.name, t.dtype))
            .collect();
        Self(Arc::new(dtypes))
    }
}

impl ModuleAdapter for ModelDtypes {
    fn adapt(&self, tensor: PackTensor, _: ModuleContext<'_>) -> PackTensor {
        match self.0.get(&tensor.name) {
            Some(&dtype) => cast_float(tensor, dtype),
            None => tensor,
        }
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(self.clone())
    }
}
