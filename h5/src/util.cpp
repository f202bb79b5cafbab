// The shared HDF5 helpers (fsdp_h5/util.h).
#include "fsdp_h5/util.h"

namespace fsdp_h5 {

void write_string_attr(H5::H5Object& obj, const std::string& name, const std::string& value,
                       EmptyString empty) {
  H5::StrType type(H5::PredType::C_S1, value.empty() ? 1 : value.size());
  H5::Attribute a = obj.createAttribute(name, type, H5::DataSpace(H5S_SCALAR));
  a.write(type, value.empty() && empty == EmptyString::Space ? std::string(" ") : value);
}

std::optional<std::string> find_string_attr(const H5::H5Object& obj, const std::string& name,
                                            EmptyString empty) {
  if (!obj.attrExists(name)) return std::nullopt;
  H5::Attribute a = obj.openAttribute(name);
  std::string out;
  a.read(a.getStrType(), out);
  if (empty == EmptyString::Space && out == " ") return std::string();
  return out;
}

std::string read_string_attr(const H5::H5Object& obj, const std::string& name,
                             EmptyString empty) {
  if (!obj.attrExists(name)) throw AttributeError("attribute " + name + " is missing");
  if (obj.openAttribute(name).getTypeClass() != H5T_STRING) {
    throw AttributeError("attribute " + name + " is not a string");
  }
  return *find_string_attr(obj, name, empty);
}

void write_int_attr(H5::H5Object& obj, const std::string& name, int64_t value) {
  obj.createAttribute(name, H5::PredType::STD_I64LE, H5::DataSpace(H5S_SCALAR))
      .write(H5::PredType::NATIVE_INT64, &value);
}

int64_t read_int_attr(const H5::H5Object& obj, const std::string& name) {
  if (!obj.attrExists(name)) throw AttributeError("attribute " + name + " is missing");
  H5::Attribute a = obj.openAttribute(name);
  if (a.getTypeClass() != H5T_INTEGER) {
    throw AttributeError("attribute " + name + " is not an integer");
  }
  int64_t v = 0;
  a.read(H5::PredType::NATIVE_INT64, &v);
  return v;
}

void set_uint64_attr(H5::H5Object& obj, const std::string& name, uint64_t value) {
  H5::Attribute a =
      obj.attrExists(name)
          ? obj.openAttribute(name)
          : obj.createAttribute(name, H5::PredType::STD_U64LE, H5::DataSpace(H5S_SCALAR));
  a.write(H5::PredType::NATIVE_UINT64, &value);
}

uint64_t read_uint64_attr(const H5::H5Object& obj, const std::string& name) {
  uint64_t v = 0;
  obj.openAttribute(name).read(H5::PredType::NATIVE_UINT64, &v);
  return v;
}

std::vector<hsize_t> extent(const H5::DataSet& ds) {
  H5::DataSpace space = ds.getSpace();
  std::vector<hsize_t> dims(static_cast<size_t>(space.getSimpleExtentNdims()));
  if (!dims.empty()) space.getSimpleExtentDims(dims.data());
  return dims;
}

std::vector<int64_t> dims_of(const H5::DataSet& ds) {
  const std::vector<hsize_t> dims = extent(ds);
  return {dims.begin(), dims.end()};
}

std::string type_name(const H5::DataSet& ds) {
  const H5T_class_t c = ds.getTypeClass();
  const size_t bits = ds.getDataType().getSize() * 8;
  if (c == H5T_FLOAT) return "float" + std::to_string(bits);
  if (c == H5T_INTEGER) return "int" + std::to_string(bits);
  if (c == H5T_STRING) return "string";
  return "a non-numeric type";
}

std::vector<std::string> child_names(const H5::Group& g) {
  std::vector<std::string> out;
  for (hsize_t i = 0; i < g.getNumObjs(); ++i) out.push_back(g.getObjnameByIdx(i));
  return out;
}

H5::DataSet write_dataset(H5::Group& g, const std::string& name, const H5::PredType& file_type,
                          const std::vector<hsize_t>& dims, const void* data,
                          const H5::PredType& mem_type) {
  const H5::DataSpace space = dims.empty()
                                  ? H5::DataSpace(H5S_SCALAR)
                                  : H5::DataSpace(static_cast<int>(dims.size()), dims.data());
  H5::DataSet ds = g.createDataSet(name, file_type, space);
  if (space.getSimpleExtentNpoints() > 0) ds.write(data, mem_type);
  return ds;
}

}  // namespace fsdp_h5
